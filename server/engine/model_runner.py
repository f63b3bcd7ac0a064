"""Builds the flat batch for one step, runs the model over the paged cache and samples the next tokens."""

import torch

from strata.cache.kv.storage import KVStorage
from strata.kernels import AttentionBackend, AttentionMetadata
from strata.models.llama import LlamaForCausalLM
from strata.server.engine.cuda_graph_runner import DecodeGraphs
from strata.server.engine.logprobs import TokenLogprob, fill_prompt_logprobs, token_logprobs
from strata.server.engine.sampler import RowError, sample
from strata.server.engine.scheduler import ScheduledBatch
from strata.server.engine.sequence import Sequence
from strata.server.engine.spec.verify import draft_logprobs, verify


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVStorage, swap: KVStorage | None, backend: AttentionBackend,
                 graphs: DecodeGraphs | None = None, eos_token_ids: frozenset[int] = frozenset()):
        """eos_token_ids: what the sampler holds back until a request's min_tokens."""
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.kv = kv
        self.swap = swap
        self.backend = backend
        self.graphs = graphs  # pure-decode steps that fit a bucket run through it; None = always eager
        self.device = kv.device
        self.block_size = kv.layout.block_size

    def copy_blocks(self, batch: ScheduledBatch) -> None:
        """Swap-outs first (their blocks may be reused by this very step), then swap-ins."""
        if batch.swap_out:
            self.kv.copy_blocks_to(self.swap, batch.swap_out)
        if batch.swap_in:
            self.swap.copy_blocks_to(self.kv, batch.swap_in)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch
            ) -> tuple[list[Sequence], list[list[int] | RowError], list[list[TokenLogprob | None]]]:
        """Run one step; return the sequences that reached their last known token, their new tokens (one, or a
        verified draft's accepted tokens and one more) or a RowError, and, for those that asked, the tokens'
        logprobs."""
        hidden, sample_rows, sampled = self.forward(batch)
        try:
            self._prompt_logprobs(batch, hidden)
            if not sampled:
                return [], [], []
            logits = self.model.compute_logits(hidden[self._tensor(sample_rows)])
            if not any(seq.draft_token_ids for seq in sampled):
                tokens = sample(logits, sampled, self.eos_token_ids)
                return (sampled, [t if isinstance(t, RowError) else [t] for t in tokens],
                        [[lp] for lp in token_logprobs(logits, sampled, tokens)])
            new_tokens = verify(logits, sampled, self.eos_token_ids)
            return sampled, new_tokens, draft_logprobs(logits, sampled, new_tokens)
        except BaseException:
            self._rewind(batch)
            raise

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Prompt logprobs of the prefill chunks that asked (a chunk's rows come first in the batch, in order)."""
        row = 0
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens - n          # forward advanced it already
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                fill_prompt_logprobs(self.model.compute_logits(hidden[row:row + n]), seq, start)
            row += n + (len(seq.draft_token_ids) if seq.num_computed_tokens == len(seq.token_ids) else 0)

    @staticmethod
    def _rewind(batch: ScheduledBatch) -> None:
        """Undo forward's progress: the engine retries a failed step request by request, which needs each request
        where it was before the step (a rerun of forward rewrites the same KV slots, which is harmless)."""
        for seq, n in batch.prefills:
            seq.num_computed_tokens -= n
        for seq in batch.decodes:
            seq.num_computed_tokens -= 1

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int], list[Sequence]]:
        """Copy blocks, run the model over the batch; return hidden states and the rows that end a sequence."""
        self.copy_blocks(batch)
        input_ids, positions, slots, sample_rows, sampled = [], [], [], [], []
        cu_seqlens, prefill_lens, prefill_tables = [0], [], []
        bs = self.block_size
        for seq, n in batch.prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            last = end == len(seq.token_ids)
            draft = seq.draft_token_ids if last else []     # a draft is verified with the prompt's last chunk
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(draft)
            end += len(draft)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu_seqlens.append(len(input_ids))
            prefill_lens.append(end)
            prefill_tables.append(table)
            if last:
                sample_rows.extend(range(len(input_ids) - 1 - len(draft), len(input_ids)))
                sampled.append(seq)
        num_prefill_tokens = len(input_ids)
        decode_lens, decode_tables = [], []
        for seq in batch.decodes:
            # a draft's tokens are decode rows too, each attending to the sequence up to itself: one verify path
            # for every decode kernel (C++, Triton, torch) and for the CUDA graphs
            first = seq.num_computed_tokens
            for p, token in enumerate([seq.token_ids[first], *seq.draft_token_ids], start=first):
                input_ids.append(token)
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                decode_lens.append(p + 1)
                decode_tables.append(seq.block_table)
                sample_rows.append(len(input_ids) - 1)
            sampled.append(seq)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_prefill_tokens=num_prefill_tokens,
            prefill_cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
            prefill_context_lens=self._tensor(prefill_lens, torch.int32),
            prefill_block_tables=self._tables(prefill_tables),
            decode_context_lens=self._tensor(decode_lens, torch.int32),
            decode_block_tables=self._tables(decode_tables),
            prefill_cu_seqlens_q_host=cu_seqlens,
            prefill_context_lens_host=prefill_lens,
        )
        input_ids, positions = self._tensor(input_ids), self._tensor(positions)
        bucket = None
        if self.graphs is not None and not batch.prefills:
            bucket = self.graphs.bucket_for(len(decode_lens), meta.decode_block_tables.shape[1])
        if bucket is not None:
            hidden = self.graphs.run(bucket, input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv.layers, meta, self.backend)
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        return hidden, sample_rows, sampled

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32, device=self.device).reshape(len(tables), width)
