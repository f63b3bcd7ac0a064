"""`strata bench throughput`: one fixed workload through our engine and through HF `generate` in static batches."""

import platform
import random
import time

import torch

from strata.models.packed_linear import PackedLinear
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, workload_seed: int) -> list[tuple[list[int], int]]:
    """Random prompts (token ids drawn from the vocabulary) with fixed output lengths: same work for both sides."""
    rng = random.Random(workload_seed)
    return [
        ([rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(num_requests)
    ]


def time_engine(engine: LLMEngine, workload: list[tuple[list[int], int]]) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outs = engine.generate([p for p, _ in workload], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(n for _, n in workload)
    return {"output_tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2)}


def load_hf(engine: LLMEngine, dtype: torch.dtype):
    """The same weights in transformers (dummy shapes get our random weights copied over)."""
    from transformers import AutoModelForCausalLM

    if engine.model_path is not None:
        return AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=dtype).eval()
    from strata.models.named_shapes import hf_config_for

    hf = AutoModelForCausalLM.from_config(hf_config_for(engine.config.model_config), dtype=dtype).eval()
    ours = dict(engine.model.named_parameters()) | {
        f"{name}.weight": module.unpacked_weight() for name, module in engine.model.named_modules()
        if isinstance(module, PackedLinear)}
    for name, param in hf.named_parameters():
        with torch.no_grad():
            param.copy_(_hf_tensor(ours, name, engine.model_config))
    return hf


def _hf_tensor(ours: dict, name: str, cfg) -> torch.Tensor:
    parent, _, leaf = name.rpartition(".")
    module, _, proj = parent.rpartition(".")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    splits = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
              "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
              "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size)}
    if proj in splits:
        fused, start, size = splits[proj]
        return ours[f"{module}.{fused}.{leaf}"][start:start + size]
    return ours["model.embed_tokens.weight"] if name == "lm_head.weight" and name not in ours else ours[name]


def time_hf(model, workload: list[tuple[list[int], int]], batch_size: int, device: torch.device) -> dict:
    """Static batches, left-padded; each batch runs until its longest request is done (no EOS stop)."""
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(workload), batch_size):
        chunk = workload[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(chunk):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                           max_new_tokens=max(n for _, n in chunk), min_new_tokens=max(n for _, n in chunk),
                           pad_token_id=0)
        tokens += sum(n for _, n in chunk)  # useful tokens: what each request asked for
    seconds = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2)}


def batch1_decode(run, n: int) -> float:
    """Decode tok/s at batch 1: (time for n tokens - time for 1 token) / (n - 1), so prefill cancels out."""
    run(1)
    t0 = time.perf_counter(); run(1); one = time.perf_counter() - t0
    t0 = time.perf_counter(); run(n); full = time.perf_counter() - t0
    return round((n - 1) / max(full - one, 1e-9), 2)


def run_throughput(config: EngineConfig, num_requests: int = 64, prompt_range=(16, 512), output_range=(16, 256),
                   hf_batch_size: int = 8, batch1_tokens: int = 64, skip_hf: bool = False, workload_seed: int = 0) -> dict:
    if config.kv_cache_memory == "auto":
        config.kv_cache_memory = "3GiB"
    engine = LLMEngine(config)
    if prompt_range[1] + output_range[1] > engine.max_model_len:     # the longest would end early, at the context
        raise ValueError(f"prompts of up to {prompt_range[1]} tokens plus outputs of up to {output_range[1]} exceed the "
                         f"context of {engine.max_model_len} tokens: lower --max-prompt / --max-output")
    workload = make_workload(num_requests, prompt_range, output_range, engine.model_config.vocab_size, workload_seed)
    engine.generate([workload[0][0]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    result = {"engine": time_engine(engine, workload)}
    prompt = workload[0][0][:32]

    def ours(n: int) -> None:
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    batch1 = {"engine_tok_s": batch1_decode(ours, batch1_tokens)}
    if not skip_hf:
        hf = load_hf(engine, engine.dtype).to(engine.device)
        result["hf"] = time_hf(hf, workload, hf_batch_size, engine.device)
        result["ratio"] = round(result["engine"]["tok_s"] / result["hf"]["tok_s"], 2)

        def theirs(n: int) -> None:
            with torch.inference_mode():
                hf.generate(torch.tensor([prompt], device=engine.device), do_sample=False, max_new_tokens=n,
                            min_new_tokens=n, pad_token_id=0)

        batch1["hf_tok_s"] = batch1_decode(theirs, batch1_tokens)
        batch1["ratio"] = round(batch1["engine_tok_s"] / batch1["hf_tok_s"], 2)
    result["batch1_decode"] = batch1
    result["settings"] = {
        "model": engine.model_id, "dtype": str(engine.dtype).removeprefix("torch."), "kv_dtype": engine.kv_layout.kv_dtype,
        "device": str(engine.device), "num_requests": num_requests, "prompt_tokens": list(prompt_range),
        "output_tokens": list(output_range), "hf_static_batch": hf_batch_size, "workload_seed": workload_seed, "greedy": True,
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": config.block_size, "threads": torch.get_num_threads(), "machine": platform.processor()
        or platform.machine(),
    }
    return result
