"""`strata bench kv | prefix | int8-accuracy`: what block size, KV dtype, swap and prefix caching buy on a workload
that oversubscribes a small KV pool, and what INT8 KV costs in accuracy."""

import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from strata.server.bench.data_files import packaged
from strata.server.bench.throughput import make_workload
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine, RequestOutput
from strata.server.engine.sampling_params import SamplingParams

TEXT = packaged("public_domain_en.txt")  # first line names the sources
PROMPTS = packaged("int8_prompts.json")
SWAP_GIB = 0.25


def sweep_settings() -> list[dict]:
    """Every block_size x kv_dtype with swap preemption and prefix caching on, then at block 16 (fp32, int8) one
    row with swap off (recompute) and one with prefix caching off: a subset, since every row reloads the model."""
    rows = [dict(block_size=b, kv_dtype=d, swap_gib=SWAP_GIB, preemption_mode="swap", prefix_caching=True)
            for b in (8, 16, 32) for d in ("fp32", "bf16", "int8")]
    for dtype in ("fp32", "int8"):
        rows.append(dict(block_size=16, kv_dtype=dtype, swap_gib=0.0, preemption_mode="recompute",
                         prefix_caching=True))
        rows.append(dict(block_size=16, kv_dtype=dtype, swap_gib=SWAP_GIB, preemption_mode="swap",
                         prefix_caching=False))
    return rows


def text_ids(engine: LLMEngine) -> list[int]:
    """The public-domain text as token ids, without its sources line."""
    return engine.tokenizer.encode(TEXT.read_text().split("\n", 1)[1].strip())


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return names[0] if names else platform.machine()


def cpu_isa() -> list[str]:
    """The vector-ISA flags of /proc/cpuinfo: what the kernels and --dtype auto had to work with."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return [flag for flag in flags if flag.startswith(("avx", "fma", "f16c", "amx"))]


def machine_note(load_at_start: tuple[float, float, float]) -> str:
    """The host and how busy it was: the numbers depend on what else shared the CPUs."""
    start, end = (", ".join(f"{x:.2f}" for x in load) for load in (load_at_start, os.getloadavg()))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()}-core {cpu_name()}, {gpu}; load average (1, 5, 15 min) at start {start}, at end {end}"


def drive(engine: LLMEngine, requests: list[tuple[list[int], int]]) -> tuple[list[RequestOutput], int, float]:
    """Submit every request at once and step to completion: outputs in order, the most sequences running after
    any step (what the pool really held), and the wall time."""
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in requests]
    done, most = {}, 0
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        most = max(most, len(engine.scheduler.running))
    return [done[i] for i in ids], most, time.perf_counter() - start


def p50_ms(outs: list[RequestOutput]) -> float:
    return round(statistics.median(o.ttft_s for o in outs) * 1000, 1)


def shared_prefix_workload(vocab_size: int, num_requests: int, system_tokens: int, unique_range: tuple[int, int],
                           output_tokens: int, workload_seed: int) -> list[tuple[list[int], int]]:
    """Requests that all start with the same system prompt, then a prompt of their own."""
    system = make_workload(1, (system_tokens, system_tokens), (0, 0), vocab_size, workload_seed + 1)[0][0]
    own = make_workload(num_requests, unique_range, (output_tokens, output_tokens), vocab_size, workload_seed)
    return [(system + prompt, n) for prompt, n in own]


def run_row(base: EngineConfig, setting: dict, workload_for: Callable[[int], list[tuple[list[int], int]]],
            ppl_tokens: int, ppls: dict) -> dict:
    """One setting on a fresh engine; perplexity is computed once per (block_size, kv_dtype) and reused."""
    config = dataclasses.replace(base, block_size=setting["block_size"], kv_dtype=setting["kv_dtype"],
                                 swap_space=setting["swap_gib"], preemption_mode=setting["preemption_mode"],
                                 enable_prefix_caching=setting["prefix_caching"])
    engine = LLMEngine(config)
    workload = workload_for(engine.model_config.vocab_size)
    key = (setting["block_size"], setting["kv_dtype"])
    if key not in ppls:
        # A model without a tokenizer (tiny test checkpoints) scores the shared system prompt instead.
        ids = text_ids(engine) if engine.tokenizer is not None else workload[0][0]
        ppls[key] = round(engine.perplexity(ids[:ppl_tokens]), 4)
    drive(engine, [([3, 5, 7, 11], 2)])  # warm-up, outside the timing
    outs, most, seconds = drive(engine, workload)
    stats = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    return {**setting, "tok_s": round(tokens / seconds, 2), "ttft_ms_p50": p50_ms(outs),
            "kv_tokens_capacity": engine.kv_capacity_tokens, "max_running_seqs": most,
            "preemptions": int(stats["preemptions_swap"] + stats["preemptions_recompute"]),
            "preemptions_swap": int(stats["preemptions_swap"]),
            "prefix_cache_hit_tokens": int(stats["prefix_cache_hit_tokens"]),
            "seconds": round(seconds, 2), "ppl": ppls[key]}


def run_kv_sweep(config: EngineConfig, settings: list[dict] | None = None, num_requests: int = 24,
                 system_tokens: int = 128, unique_range: tuple[int, int] = (16, 48), output_tokens: int = 32,
                 ppl_tokens: int = 512, workload_seed: int = 0) -> list[dict]:
    """One row per setting, all on the same workload and the same --kv-cache-memory."""
    workload_for = functools.partial(shared_prefix_workload, num_requests=num_requests, system_tokens=system_tokens,
                                     unique_range=unique_range, output_tokens=output_tokens, workload_seed=workload_seed)
    ppls: dict = {}
    return [run_row(config, setting, workload_for, ppl_tokens, ppls) for setting in settings or sweep_settings()]


def capacity_ratios(rows: list[dict]) -> dict:
    """int8 tokens held per bf16 and per fp32 token at the same pool size, per block size."""
    cap = {(r["block_size"], r["kv_dtype"]): r["kv_tokens_capacity"] for r in rows}
    return {f"block_{b}": {f"int8_over_{d}": round(cap[b, "int8"] / cap[b, d], 3) for d in ("bf16", "fp32")
                           if (b, d) in cap}
            for b in sorted({b for b, dt in cap if dt == "int8"})}


def sweep_report(rows: list[dict], config: EngineConfig, load_at_start: tuple[float, float, float], **workload) -> dict:
    """The rows plus what a reader needs to reproduce them."""
    return {
        "settings": {
            "sweep": sweep_settings.__doc__.strip().replace("\n    ", " "),
            "model": config.model or "SmolLM2-135M-Instruct",
            "dtype": config.dtype, "kv_cache_memory": config.kv_cache_memory, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, **workload,
            "workload": "every request starts with the same system prompt (random token ids), then its own prompt; "
                        "all submitted at once, greedy, ignore_eos; tok_s = output tokens / wall time",
            "ppl": f"perplexity of the first ppl_tokens tokens of server/bench/data/{TEXT.name} through the "
                   "row's KV pool (see int8_accuracy.json for the whole text)",
            "threads": torch.get_num_threads(), "machine_note": machine_note(load_at_start),
        },
        "capacity_ratios": capacity_ratios(rows),
        "rows": rows,
    }


def plot_sweep(rows: list[dict], path: Path) -> None:
    """Two bar charts, one bar per row: output tok/s and KV capacity in tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"b{r['block_size']} {r['kv_dtype']} {'swap' if r['swap_gib'] else 'recompute'}"
              f"{'' if r['prefix_caching'] else ' no-prefix'}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.4 * len(rows) + 1.5), sharey=True)
    for ax, key, title in ((axes[0], "tok_s", "output tok/s"), (axes[1], "kv_tokens_capacity", "KV capacity (tokens)")):
        ax.barh(labels, [r[key] for r in rows], color=["C0" if r["kv_dtype"] == "fp32" else "C1" if
                                                        r["kv_dtype"] == "bf16" else "C2" for r in rows])
        ax.set_title(title)
    axes[0].invert_yaxis()  # first row on top (the axes share y, so once)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_prefix_ttft(config: EngineConfig, num_requests: int = 16, system_tokens: int = 1024,
                    unique_range: tuple[int, int] = (16, 48), output_tokens: int = 4, workload_seed: int = 0) -> dict:
    """TTFT of requests sharing a long system prompt, prefix caching on vs off: the first request runs alone (with
    caching on it computes the prefix), then the others arrive together; p50 is over those others."""
    result, load_at_start = {}, os.getloadavg()
    for on in (True, False):
        engine = LLMEngine(dataclasses.replace(config, enable_prefix_caching=on))
        workload = shared_prefix_workload(engine.model_config.vocab_size, num_requests, system_tokens, unique_range,
                                          output_tokens, workload_seed)
        drive(engine, [([3, 5, 7, 11], 2)])  # warm-up
        first, _, _ = drive(engine, workload[:1])
        rest, _, seconds = drive(engine, workload[1:])
        result["on" if on else "off"] = {
            "first_ttft_ms": p50_ms(first), "ttft_ms_p50": p50_ms(rest),
            "ttft_ms_max": round(max(o.ttft_s for o in rest) * 1000, 1), "seconds": round(seconds, 2),
            "cached_tokens_mean": round(statistics.mean(o.num_cached_tokens for o in rest), 1),
        }
    result["speedup_p50"] = round(result["off"]["ttft_ms_p50"] / result["on"]["ttft_ms_p50"], 2)
    result["settings"] = {"num_requests": num_requests, "system_prompt_tokens": system_tokens,
                          "own_prompt_tokens": list(unique_range), "output_tokens": output_tokens, "workload_seed": workload_seed,
                          "kv_dtype": engine.kv_layout.kv_dtype, "block_size": config.block_size,
                          "kv_cache_memory": config.kv_cache_memory,
                          "max_num_batched_tokens": config.max_num_batched_tokens,
                          "threads": torch.get_num_threads(), "machine_note": machine_note(load_at_start)}
    return result


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Position-by-position agreement up to each output's first divergence, and the share fully identical."""
    matched = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
               for a, b in zip(reference, other, strict=True)]
    total = sum(len(a) for a in reference)
    return {"token_agreement_to_first_divergence": round(sum(matched) / total, 4),
            "fully_identical_share": round(sum(n == len(a) for n, a in zip(matched, reference, strict=True)) / len(reference), 4),
            "first_divergence_positions": matched}


def perplexity_and_greedy(configs: dict[str, EngineConfig], chat: list[str], raw: list[str], params: SamplingParams,
                          text_tokens: int | None = None, decode_chunk: int | None = None
                          ) -> tuple[dict[str, float], dict[str, float], dict[str, list[list[int]]], int]:
    """One fresh engine per named variant: perplexity of the public-domain text (its first text_tokens; None = all)
    and the greedy token ids of the chat + raw prompts. With decode_chunk, the perplexity again in chunks that small,
    which run the linears decode steps run (the CPU row kernel), not prefill's. Also returns how many text tokens
    were scored."""
    ppl, ppl_decode, tokens = {}, {}, {}
    for name, variant in configs.items():
        engine = LLMEngine(variant)
        ids = text_ids(engine)[:text_tokens]
        ppl[name] = round(engine.perplexity(ids), 4)
        if decode_chunk is not None:
            ppl_decode[name] = round(engine.perplexity(ids, chunk_size=decode_chunk), 4)
        outs = engine.generate(chat, params, chat=True) + engine.generate(raw, params)
        tokens[name] = [o.token_ids for o in outs]
    return ppl, ppl_decode, tokens, len(ids)


def run_int8_accuracy(config: EngineConfig, max_tokens: int = 64,
                      kv_dtypes: tuple[str, ...] = ("bf16", "int8")) -> dict:
    """Perplexity of the public-domain text and greedy outputs of the 32 prompts, each KV dtype against fp32 KV;
    bf16 is there as the yardstick of what a lossless-looking KV change already does to greedy outputs."""
    prompts = json.loads(PROMPTS.read_text())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    load_at_start = os.getloadavg()
    configs = {kv_dtype: dataclasses.replace(config, kv_dtype=kv_dtype) for kv_dtype in ("fp32", *kv_dtypes)}
    ppl, _, tokens, text_tokens = perplexity_and_greedy(configs, prompts["chat"], prompts["raw"], params)
    return {
        "ppl": ppl,
        "ppl_increase_pct_vs_fp32": {d: round((ppl[d] / ppl["fp32"] - 1) * 100, 3) for d in kv_dtypes},
        "greedy_vs_fp32": {d: agreement(tokens["fp32"], tokens[d]) for d in kv_dtypes},
        "settings": {"text": f"server/bench/data/{TEXT.name}", "text_tokens": text_tokens,
                     "prompts": f"{len(prompts['chat'])} chat (chat template) + {len(prompts['raw'])} raw "
                                f"(server/bench/data/{PROMPTS.name})",
                     "max_tokens": max_tokens, "greedy": True, "ignore_eos": True,
                     "dtype": str(config.resolve_dtype(config.resolve_device())).removeprefix("torch."), "block_size": config.block_size,
                     "kv_cache_memory": config.kv_cache_memory, "threads": torch.get_num_threads(),
                     "machine_note": machine_note(load_at_start)},
    }
