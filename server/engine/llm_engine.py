"""LLMEngine: add requests, step the scheduler + runner, stream outputs; the HTTP server drives it."""

import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from strata.cache.kv.block_manager import BlockManager
from strata.cache.kv.storage import KVLayout, KVStorage
from strata.cache.kv.swap import SwapSpace
from strata.kernels import get_backend
from strata.models.loader import load_model
from strata.server.engine.config import EngineConfig, free_memory_bytes, kv_cache_bytes
from strata.server.engine.cuda_graph_runner import DecodeGraphs, captures_decode_graphs
from strata.server.engine.detokenizer import Detokenizer
from strata.server.engine.fingerprint import model_fingerprint
from strata.server.engine.input_processor import InputProcessor, ModelInfo, RequestError, load_tokenizer
from strata.server.engine.logprobs import TokenLogprob
from strata.server.engine.model_runner import ModelRunner
from strata.server.engine.sampler import RowError
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.scheduler import ScheduledBatch, Scheduler
from strata.server.engine.sequence import Sequence
from strata.server.engine.spec.proposer import DraftProposer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What a request produced so far; `new_*` is what this step added (for streaming)."""

    request_id: str
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float | None = None
    error: str | None = None      # finish_reason "error": why this request failed (the others went on)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)   # of new_token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None   # with the first output token, when the request asked
    spec: dict[str, dict[str, int]] | None = None   # draft source -> drafts, proposed/accepted tokens, steps saved


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        model_path = self.model_path = config.resolve_model_path()
        self.weight_format, why = config.resolve_weight_format(self.device)
        log.info("weights: %s, math in %s (%s)", self.weight_format, str(self.dtype).removeprefix("torch."), why)
        self.model = load_model(model_path, config.load_format, config.model_config, self.dtype, self.device,
                                max_model_len=config.max_model_len, seed=config.dummy_weights_seed,
                                weight_format=self.weight_format)
        cfg = self.model.config
        self.model_config = cfg
        self.max_model_len = self.model.max_model_len
        self.model_id = cfg.name or "dummy"
        self.tokenizer = load_tokenizer(config, model_path)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        kv_dtype = config.resolve_kv_dtype(self.dtype)
        self.fingerprint = model_fingerprint(config, model_path, self.dtype, kv_dtype, self.weight_format)
        self.kv_layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, kv_dtype)
        num_blocks = kv_cache_bytes(config.kv_cache_memory, self.device) // self.kv_layout.block_bytes
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-memory {config.kv_cache_memory} holds no block of "
                             f"{self.kv_layout.block_bytes} bytes")
        if num_blocks * config.block_size < self.max_model_len:
            # a sequence must fit the pool alone; past it the engine ended answers "length" while the server still
            # advertised the model's whole context
            log.warning("--kv-cache-memory %s holds %d tokens, fewer than the context of %d: serving a context of %d "
                        "(more KV memory serves the whole context)", config.kv_cache_memory,
                        num_blocks * config.block_size, self.max_model_len, num_blocks * config.block_size)
            self.max_model_len = num_blocks * config.block_size
        # One block past the scheduler's: the scratch block that padded rows of a decode graph write into.
        self.kv = KVStorage(self.kv_layout, num_blocks + 1, self.device)
        host_free = free_memory_bytes(torch.device("cpu"))
        if config.swap_space * 2**30 > host_free:
            raise ValueError(f"--swap-space {config.swap_space} GiB is more than the {host_free / 2**30:.1f} GiB of "
                             "free host memory")
        self.swap_space = SwapSpace(self.kv_layout, config.swap_space) if config.swap_space else None
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, self.fingerprint)
        self.scheduler = Scheduler(config, self.block_manager, self.swap_space,
                                   config.resolve_prefill_beside_decodes(self.device))
        self.backend = get_backend(config.attention_backend, self.device)
        graphs = None
        if captures_decode_graphs(config, self.device, self.backend):
            graphs = DecodeGraphs(self.model, self.kv, self.backend, config.max_num_seqs, self.max_model_len,
                                  scratch_block=num_blocks, dtype=self.dtype)
            graphs.capture()
        self.runner = ModelRunner(self.model, self.kv, self.swap_space.storage if self.swap_space else None,
                                  self.backend, graphs, frozenset(self.eos_token_ids))
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.info = ModelInfo(self.model_id, model_path, self.dtype, cfg.vocab_size, self.max_model_len,
                              self.kv_capacity_tokens, self.fingerprint)
        self.inputs = InputProcessor(self.info, self.tokenizer)
        self.drafter = None if config.speculative == "off" else DraftProposer(
            tuple(config.speculative.split("+")), config.num_speculative_tokens, self.max_model_len,
            config.speculative_policy)
        self.scheduler.keep_paying_drafts = self._keep_paying_drafts
        self.requests: dict[str, Sequence] = {}
        self.num_generated_tokens = 0

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.kv_layout.block_size

    # -- requests ---------------------------------------------------------------------------------------
    def enqueue(self, seq: Sequence) -> str:
        """Queue a validated sequence for scheduling."""
        if seq.request_id in self.requests:
            raise RequestError(f"request id {seq.request_id!r} is already in flight")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    chat: bool = False) -> str:
        """Validate and queue a request; raises RequestError (and queues nothing) on bad input."""
        return self.enqueue(self.inputs.make_sequence(prompt, params, request_id, chat))

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when it is unknown or already done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self._release(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, float]:
        """Counters for /metrics and benchmarks: KV blocks, prefix cache, preemptions, swap traffic."""
        bm, sched = self.block_manager, self.scheduler
        prefix = bm.stats
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_used": bm.num_blocks - bm.num_free_blocks,
            "kv_blocks_cached": len(bm.cached),
            "kv_bytes_per_token": self.kv_layout.bytes_per_token,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "swap_slots_total": self.swap_space.num_slots if self.swap_space else 0,
            "swap_slots_free": self.swap_space.num_free_slots if self.swap_space else 0,
            "swap_out_blocks": sched.stats.swap_outs,
            "swap_in_blocks": sched.stats.swap_ins,
            "preemptions_swap": sched.stats.swap,
            "preemptions_recompute": sched.stats.recompute,
            "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits,
            "prefix_cache_queried_tokens": prefix.queried_tokens,
            "prefix_cache_hit_tokens": prefix.hit_tokens,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_swapped": len(sched.swapped),
            "generated_tokens": self.num_generated_tokens,
            **(self.drafter.stats() if self.drafter else {}),
        }

    # -- stepping ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler + model step; returns an output for every request that got a token or finished."""
        if self.drafter is not None:
            sched = self.scheduler
            self.drafter.propose(sched.running + [seq for seq in sched.waiting if seq.draft_candidates])
        batch = self.scheduler.schedule()
        outputs = []
        for seq in batch.failed:
            seq.finish_reason = "length"  # cannot fit in the KV cache even alone
            outputs.append(self._finish(seq))
        if batch.empty:
            return outputs
        stepped = [seq for seq, _ in batch.prefills] + batch.decodes
        try:
            started = time.perf_counter()
            sampled, tokens, logprobs = self.runner.run(batch)
            if self.drafter is not None and not batch.prefills:     # decode and verify rows price a draft's row
                self.drafter.cost.observe(sum(1 + len(seq.draft_token_ids) for seq in batch.decodes),
                                          time.perf_counter() - started)
        except Exception:           # one request's fault must not fail the others: find it by running each alone
            log.exception("engine step of %d requests failed; running them one by one", len(stepped))
            sampled, tokens, logprobs = self._run_one_by_one(batch)
        for seq in stepped:
            if not seq.finished:
                self.block_manager.register_computed(seq, seq.num_computed_tokens)
        now = time.perf_counter()
        for seq, new, new_logprobs in zip(sampled, tokens, logprobs, strict=True):
            if seq.finished:        # aborted while the step ran
                continue
            outputs.append(self._fail(seq, new) if isinstance(new, RowError)
                           else self._append_tokens(seq, new, now, new_logprobs))
        return outputs

    def _keep_paying_drafts(self, seqs: list[Sequence], rows: int) -> None:
        if self.drafter is not None:        # (tests swap the drafter on a built engine)
            self.drafter.keep_paying(seqs, rows)

    def _run_one_by_one(self, batch: ScheduledBatch
                        ) -> tuple[list[Sequence], list[list[int] | RowError], list[list[TokenLogprob | None]]]:
        """Each sequence of a failed step alone (a model call that raised advanced nothing, and rewriting the same KV
        slots is harmless); the ones that fail alone get a RowError. Block copies already ran with the batch."""
        sampled, tokens, logprobs = [], [], []
        alone = [ScheduledBatch(prefills=[part]) for part in batch.prefills] + \
                [ScheduledBatch(decodes=[seq]) for seq in batch.decodes]
        for sub in alone:
            try:
                got, toks, lps = self.runner.run(sub)
            except Exception as exc:
                seq = (sub.prefills[0][0] if sub.prefills else sub.decodes[0])
                log.error("request %s failed in the engine: %s: %s", seq.request_id, type(exc).__name__, exc)
                got, toks, lps = [seq], [RowError(f"the engine failed on this request ({type(exc).__name__})")], [[]]
            sampled += got
            tokens += toks
            logprobs += lps
        return sampled, tokens, logprobs

    def _fail(self, seq: Sequence, why: str) -> RequestOutput:
        """End one request with finish_reason "error" and free what it holds."""
        seq.finish_reason, seq.error = "error", str(why)
        return self._finish(seq)

    def _append_tokens(self, seq: Sequence, tokens: list[int], now: float,
                       logprobs: list[TokenLogprob | None]) -> RequestOutput:
        """Append a step's tokens one by one, as plain decoding would, up to the first that ends the sequence; with
        a verified draft, keep the accepted tokens' KV and give back the rest."""
        draft = seq.draft_token_ids
        if draft:
            seq.num_computed_tokens += len(tokens) - 1      # accepted draft tokens: this step wrote their KV
            self.block_manager.truncate(seq, seq.num_computed_tokens)
        new: list[int] = []
        for token in tokens:
            new.append(token)
            if self._commit(seq, token, now):
                break
        if draft:
            self.drafter.record(seq, len(draft), len(tokens) - 1, len(new) - 1)
            seq.draft_token_ids = []
        new_text = self._release_text(seq)
        new_logprobs = [lp for lp in logprobs[:len(new)] if lp is not None]
        if seq.finish_reason is not None:
            return self._finish(seq, new, new_text, new_logprobs)
        return self._output(seq, new, new_text, new_logprobs)

    def _commit(self, seq: Sequence, token: int, now: float) -> bool:
        """Append one token and apply the stop conditions; True when it ended the sequence."""
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.params
        may_stop = seq.num_output_tokens >= params.min_tokens       # stops before min_tokens do not count (vLLM)
        stop_token = may_stop and (not params.ignore_eos and token in self.eos_token_ids
                                   or token in params.stop_token_ids)
        # A stop token's own text is left out, as a stop string's is, unless include_stop_str_in_output.
        keep_text = self.detokenizer is not None and (not stop_token or params.include_stop_str_in_output)
        fresh = self.detokenizer.update(seq) if keep_text else ""
        if stop_token:
            seq.finish_reason = "stop"
        elif may_stop and params.stop and self._truncate_at_stop(seq, fresh):
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    @staticmethod
    def _release_text(seq: Sequence) -> str:
        """Output text not streamed yet. While a stop string could still complete, the text it might start in is
        held back (it would be cut, and streamed text cannot be taken back), as vLLM does."""
        end = len(seq.output_text)
        stop = seq.params.stop
        if seq.finish_reason is None and stop and not seq.params.include_stop_str_in_output:
            end = max(end - max(len(s) for s in stop) + 1, seq.num_released_chars)
        released = seq.output_text[seq.num_released_chars:end]
        seq.num_released_chars = end
        return released

    def _truncate_at_stop(self, seq: Sequence, new_text: str) -> bool:
        """Cut the output at the first stop string that the newest text completes (after it with
        include_stop_str_in_output). One that ended in older text was completed before min_tokens: it does not count."""
        new_start = len(seq.output_text) - len(new_text)
        hits = [(i, len(s)) for s in seq.params.stop
                if (i := seq.output_text.find(s, max(0, new_start - len(s) + 1))) != -1]
        if not hits:
            return False
        start, length = min(hits)
        seq.output_text = seq.output_text[:start + length if seq.params.include_stop_str_in_output else start]
        return True

    def _finish(self, seq: Sequence, new_tokens: list[int] | None = None, new_text: str = "",
                new_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        self.requests.pop(seq.request_id, None)
        self._release(seq)
        return self._output(seq, new_tokens or [], new_text, new_logprobs or [])

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.detokenizer:
            self.detokenizer.forget(seq.request_id)

    def _output(self, seq: Sequence, new_tokens: list[int], new_text: str,
                new_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=seq.output_token_ids,
            text=seq.output_text,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            error=seq.error,
            new_logprobs=new_logprobs or [],
            # with the first output tokens (several when a draft was verified in the prompt's last step)
            prompt_logprobs=seq.prompt_logprobs if new_tokens and seq.num_output_tokens == len(new_tokens) else None,
            spec=seq.spec.summary(),
        )

    @torch.inference_mode()
    def perplexity(self, token_ids: list[int], chunk_size: int = 256) -> float:
        """Perplexity of a text through the paged cache, in prefill chunks: every attention read after the first
        chunk goes through the stored (possibly INT8) KV, as in serving."""
        if self.has_unfinished():
            raise RuntimeError("perplexity needs an idle engine")
        if len(token_ids) + 1 > min(self.max_model_len, self.kv_capacity_tokens):
            raise RequestError(f"text of {len(token_ids)} tokens does not fit the context or the KV cache")
        seq = Sequence("perplexity", list(token_ids), SamplingParams(max_tokens=1))
        self.block_manager.allocate(seq, len(token_ids))
        nll, count = 0.0, 0
        try:
            for start in range(0, len(token_ids) - 1, chunk_size):
                n = min(chunk_size, len(token_ids) - 1 - start)
                hidden, _, _ = self.runner.forward(ScheduledBatch(prefills=[(seq, n)]))
                logits = self.model.compute_logits(hidden).float()
                targets = torch.tensor(token_ids[start + 1:start + 1 + n], device=logits.device)
                nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
                count += n
        finally:
            self.block_manager.free_sequence(seq)
        return float(torch.exp(torch.tensor(nll / count)))

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 chat: bool = False, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, params_list, strict=True)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
            while len(done) < len(ids):
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update()
        return [done[i] for i in ids]
