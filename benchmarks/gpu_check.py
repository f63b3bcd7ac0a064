"""Decode throughput of our engine (with its CUDA graphs and eager) vs HF transformers `generate`, each also as a
fraction of the memory-bandwidth floor.

The floor of one decode step is (weight bytes + KV bytes read) / copy bandwidth: decode at small and medium
batch is bandwidth-bound, so this says how much of the GPU a step leaves unused. Run by benchmarks/gpu_check.sh.
"""

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from strata.models.named_shapes import hf_config_for
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Bytes/s of a big device-to-device copy (read + write counted): what a bandwidth-bound step can reach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * nbytes * iters / (time.perf_counter() - start)


def weight_bytes(model: torch.nn.Module, embedding: torch.nn.Module, lm_head: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: all of them, except an untied input embedding (B rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() counts tied ones once
    if embedding.weight.data_ptr() != lm_head.weight.data_ptr():
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts, so no prefix is shared and every sequence reads its own KV blocks."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def measure_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, bandwidth: float) -> dict:
    """Decode tok/s at the full batch: requests never finish on their own; once every one has its first token (so
    prefill is excluded), one decode step runs untimed (it may JIT-compile a kernel variant), then new_tokens - 2
    timed steps (as many as HF's), then all are aborted. The floor sums each timed step's own weight + KV bytes."""
    params = SamplingParams(max_tokens=engine.max_model_len, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    waiting = set(ids)
    while waiting:
        waiting -= {o.request_id for o in engine.step()}
    engine.step()
    weights = weight_bytes(engine.model, engine.model.model.embed_tokens, engine.model.lm_head)
    kv_per_token = engine.kv_layout.bytes_per_token
    tokens, floor_s, smallest_batch = 0, 0.0, len(prompts)
    timed_steps = new_tokens - 2
    start = time.perf_counter()  # step() returns sampled tokens on the host: the device is idle here
    for _ in range(timed_steps):
        outputs = engine.step()
        tokens += len(outputs)
        smallest_batch = min(smallest_batch, len(outputs))  # < batch: a sequence was preempted or hit the length
        context = sum(o.num_prompt_tokens + len(o.token_ids) - 1 for o in outputs)  # tokens whose KV was read
        floor_s += (weights + context * kv_per_token) / bandwidth
    elapsed = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    return {"decode_tok_s": tokens / elapsed, "timed_steps": timed_steps, "step_ms": 1e3 * elapsed / timed_steps,
            "smallest_batch": smallest_batch, "floor_tok_s": tokens / floor_s, "fraction_of_floor": floor_s / elapsed,
            "weight_bytes": weights, "kv_bytes_per_token": kv_per_token}


def measure_engine_graphs_and_eager(engine: LLMEngine, prompts: list[list[int]], new_tokens: int,
                                    bandwidth: float) -> list[dict]:
    """The same decode with the engine's CUDA graphs, then without them (what --enforce-eager runs: the runner
    with no graphs). The second run's prompts hit the prefix cache, so it skips most of the prefill."""
    graphs = engine.runner.graphs
    results = [dict(measure_engine(engine, prompts, new_tokens, bandwidth), cuda_graphs=graphs is not None)]
    if graphs is not None:
        engine.runner.graphs = None
        try:
            results.append(dict(measure_engine(engine, prompts, new_tokens, bandwidth), cuda_graphs=False))
        finally:
            engine.runner.graphs = graphs
    return results


class StepClock:
    """A logits processor that only timestamps: HF calls it once per forward, the prefill's included."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def measure_hf(model, prompts: list[list[int]], new_tokens: int, bandwidth: float) -> dict:
    """HF `generate` (bf16 DynamicCache, sdpa), greedy; timed from the end of its first decode step to the last."""
    from transformers import LogitsProcessorList

    cfg = model.config
    device = model.device
    input_ids = torch.tensor(prompts, device=device)
    clock = StepClock(device)
    model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   logits_processor=LogitsProcessorList([clock]))
    assert len(clock.times) == new_tokens, f"expected {new_tokens} forwards, timed {len(clock.times)}"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
    weights = weight_bytes(model, model.get_input_embeddings(), model.get_output_embeddings())
    batch, prompt_len = input_ids.shape
    # Forward i (1-based; 1 is the prefill) reads the KV of prompt_len + i - 1 tokens; forwards 3..N are timed.
    floor_s = sum(weights + batch * (prompt_len + i - 1) * kv_per_token for i in range(3, new_tokens + 1)) / bandwidth
    elapsed = clock.times[-1] - clock.times[1]
    tokens = batch * (new_tokens - 2)
    return {"decode_tok_s": tokens / elapsed, "timed_steps": new_tokens - 2,
            "step_ms": 1e3 * elapsed / (new_tokens - 2),
            "floor_tok_s": tokens / floor_s, "fraction_of_floor": floor_s / elapsed,
            "weight_bytes": weights, "kv_bytes_per_token": kv_per_token}


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


class Report:
    """Results are written after every measurement, so a run cut short by its time limit still leaves data."""

    def __init__(self, path: Path, header: dict):
        self.path = path
        self.data = dict(header, results=[])

    def add(self, entry: dict) -> None:
        self.data["results"].append(entry)
        print(json.dumps(entry), flush=True)
        self.path.write_text(json.dumps(self.data, indent=2))


def run_strata(report: Report, args: argparse.Namespace, name: str, kv_dtype: str, bandwidth: float,
               deadline: float) -> None:
    """One engine (its start timed: dummy weights, KV pool, graph capture), every batch with graphs and eager."""
    head = {"impl": "strata", "model": name, "kv_dtype": kv_dtype}
    if time.monotonic() > deadline:
        report.add(dict(head, skipped="time budget"))
        return
    max_batch = max(args.batches)
    max_batched_tokens = max(8192, 2 * max_batch)
    # Requests decode while later ones are still prefilling (at most max_batched_tokens - max_batch tokens a step)
    prefill_steps = -(-max_batch * args.prompt_len // (max_batched_tokens - max_batch))
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=None, load_format="dummy", model_config=name, dtype="bf16", kv_dtype=kv_dtype,
        max_num_seqs=max_batch, max_num_batched_tokens=max_batched_tokens,
        max_model_len=args.prompt_len + args.new_tokens + prefill_steps + 16, kv_cache_memory=args.kv_cache_memory,
        attention_backend="auto"))
    graphs = engine.runner.graphs
    report.add(dict(head, engine_start_s=time.perf_counter() - started,
                    graph_buckets=sorted(graphs.graphs) if graphs else []))
    vocab = engine.model_config.vocab_size
    for batch in args.batches:
        entry = dict(head, batch=batch, attention_backend=engine.backend.name)
        if time.monotonic() > deadline:
            report.add(dict(entry, skipped="time budget"))
            continue
        prompts = random_prompts(batch, args.prompt_len, vocab, seed=batch)
        for result in measure_engine_graphs_and_eager(engine, prompts, args.new_tokens, bandwidth):
            report.add(dict(entry, **result))
    del engine, graphs
    release()


def run_hf(report: Report, args: argparse.Namespace, name: str, bandwidth: float, deadline: float) -> None:
    from transformers import AutoModelForCausalLM

    if time.monotonic() > deadline:
        report.add({"impl": "hf-transformers", "model": name, "skipped": "time budget"})
        return
    config = hf_config_for(name)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    for batch in args.batches:
        entry = {"impl": "hf-transformers", "model": name, "kv_dtype": "bf16", "batch": batch}
        if time.monotonic() > deadline:
            report.add(dict(entry, skipped="time budget"))
            continue
        prompts = random_prompts(batch, args.prompt_len, config.vocab_size, seed=batch)
        with torch.inference_mode():
            report.add(dict(entry, **measure_hf(model, prompts, args.new_tokens, bandwidth)))
        release()
    del model
    release()


def run(args: argparse.Namespace) -> None:
    """Every model's like-for-like pair first (Strata with the first KV dtype, then HF), then the other KV dtypes,
    so a run cut short by the budget loses the least comparable results first (the first H200 run spent its budget
    on Llama-3.2-1B's extras and never reached Llama-3.1-8B). Quantized weights are not run: the engine refuses
    them on CUDA until their CUDA-graph test passes (gpu_weight_linear.py times the kernel alone)."""
    device = torch.device("cuda")
    deadline = time.monotonic() + args.budget_s
    bandwidth = copy_bandwidth(device)
    report = Report(Path(args.out) / "gpu_check.json", {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
        "copy_bandwidth_GBps": bandwidth / 1e9, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
    })
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    first, *others = args.kv_dtypes
    for name in args.models:
        run_strata(report, args, name, first, bandwidth, deadline)
        run_hf(report, args, name, bandwidth, deadline)
    for name in args.models:
        for kv_dtype in others:
            run_strata(report, args, name, kv_dtype, bandwidth, deadline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--models", nargs="+", default=["Llama-3.2-1B", "Llama-3.1-8B"])
    parser.add_argument("--kv-dtypes", nargs="+", default=["bf16", "int8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="0.6", help="engine KV pool: bytes or a fraction of free memory")
    parser.add_argument("--budget-s", type=float, default=270.0, help="start no new measurement after this")
    args = parser.parse_args()
    if args.new_tokens < 4:
        parser.error("--new-tokens must be >= 4 (two decode steps are untimed)")
    if not torch.cuda.is_available():
        sys.exit(f"gpu_check: no CUDA device visible to torch {torch.__version__} (built for CUDA "
                 f"{torch.version.cuda}); this benchmark needs an NVIDIA GPU and a CUDA build of torch")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
