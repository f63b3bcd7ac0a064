"""`strata bench spec`: decode speed with and without speculative drafts, on workloads where drafts should pay
(extract or summarise a long context, rewrite code, repeat a question answered before at another temperature) and
where they should not (open chat); greedy, so outputs must be identical to the run without drafts.

Both sides run in one engine, one after the other per workload and batch size (drafts on and off by swapping the
engine's proposer), so a busy shared CPU slows both alike; each side keeps its best of `repeats` runs.
"""

import dataclasses
import os
import time
from pathlib import Path

import torch

from strata.server.bench.data_files import packaged
from strata.server.bench.kv import machine_note
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine, RequestOutput
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.spec.ngram import continuation
from strata.server.engine.spec.proposer import DraftProposer

CODE = '''def average(values):
    total = 0
    count = 0
    for value in values:
        if value is None:
            continue
        total = total + value
        count = count + 1
    if count == 0:
        return 0.0
    return total / count


def spread(values):
    kept = [value for value in values if value is not None]
    if not kept:
        return 0.0
    return max(kept) - min(kept)
'''
CHAT = ["Tell me about a holiday you would like to take and why.", "What makes a good friend?",
        "Write a short poem about the sea.", "Give me three ideas for a rainy afternoon.",
        "Why do people enjoy music?", "Describe your ideal breakfast."]
REPEATED = ["What are the benefits of regular exercise?", "How do plants make their food?",
            "Explain why the sky is blue.", "What is the difference between weather and climate?"]


def passages(count: int, chars: int) -> list[str]:
    """Paragraph-aligned passages of the packaged public-domain text."""
    text = packaged("public_domain_en.txt").read_text().split("\n", 1)[1]
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
    out = []
    for start in range(0, len(paragraphs)):
        passage = ""
        for p in paragraphs[start:]:
            if len(passage) + len(p) > chars:
                break
            passage += p + "\n\n"
        if passage and passage not in out:
            out.append(passage.strip())
        if len(out) == count:
            break
    return out


def workloads(num_prompts: int) -> dict[str, tuple[str, list[str]]]:
    """name -> (draft source, chat prompts)."""
    texts = passages(num_prompts, 1800)
    renames = [("total", "running_sum"), ("count", "n"), ("value", "item"), ("kept", "present")]
    return {
        "extract": ("ngram", [f"{t}\n\nCopy the first two sentences of the text above exactly." for t in texts]),
        "summarise": ("ngram", [f"{t}\n\nSummarise the text above." for t in texts]),
        "code": ("ngram", [f"{CODE}\nRewrite this code with the variable `{a}` renamed to `{b}`. Output only the code."
                           for a, b in renames[:num_prompts]]),
        "repeat": ("cache", REPEATED[:num_prompts]),
        "chat": ("ngram", CHAT[:num_prompts]),
    }


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams, drafter: DraftProposer | None,
        answers: dict[str, list[int]]) -> tuple[list[RequestOutput], float, float]:
    """All prompts at once to completion: outputs in order, decode seconds (from the moment every request has its
    first token) and the tokens produced in them."""
    engine.drafter = drafter
    ids = []
    for prompt in prompts:
        seq = engine.inputs.make_sequence(prompt, params, chat=True)
        seq.draft_candidates = [answers[prompt]] if prompt in answers else []
        ids.append(engine.enqueue(seq))
    done: dict[str, RequestOutput] = {}
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                done[out.request_id] = out
    end = time.perf_counter()
    engine.drafter = None
    outs = [done[i] for i in ids]
    decode_start = max(first.values())
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return outs, end - decode_start, decoded


def batches_of(prompts: list[str], batch: int) -> list[list[str]]:
    """Groups of `batch` prompts run one after another, so that every prompt counts at every batch size (batch 1
    is the prompts one by one, not the first prompt alone); a batch larger than the prompts repeats them."""
    groups = max(1, -(-len(prompts) // batch))
    return [[prompts[(g * batch + i) % len(prompts)] for i in range(batch)] for g in range(groups)]


def run_batches(engine: LLMEngine, groups: list[list[str]], params: SamplingParams, drafter: DraftProposer | None,
                answers: dict[str, list[int]]) -> tuple[list[RequestOutput], float, float]:
    """run() for each group in turn with one drafter (as a server keeps its drafter across requests): all outputs,
    decode seconds and decoded tokens summed."""
    outs, seconds, decoded = [], 0.0, 0
    for group in groups:
        o, s, d = run(engine, group, params, drafter, answers)
        outs, seconds, decoded = outs + o, seconds + s, decoded + d
    return outs, seconds, decoded


def prompt_lookup_ceiling(prompt_ids: list[list[int]], outputs: list[list[int]], num_tokens: int) -> float:
    """The speedup prompt lookup could give these greedy outputs if verifying a draft cost nothing: output tokens
    over the steps they take when every step proposes the continuation of the longest match (as the ngram source
    does) and keeps its prefix that equals the output. What the workload allows, whatever the kernels' speed."""
    tokens = steps = 0
    for prompt, out in zip(prompt_ids, outputs, strict=True):
        i = 0
        while i < len(out):
            context = prompt + out[:i]
            draft = continuation(context, context, num_tokens)
            accepted = next((k for k, token in enumerate(draft) if i + k >= len(out) or token != out[i + k]),
                            len(draft))
            i, steps = i + accepted + 1, steps + 1
        tokens += len(out)
    return round(tokens / steps, 3) if steps else 1.0


def run_spec_bench(config: EngineConfig, batch_sizes: tuple[int, ...] = (1, 4, 16), max_tokens: int = 96,
                   num_prompts: int = 4, repeats: int = 2, names: tuple[str, ...] | None = None) -> dict:
    load_at_start = os.getloadavg()
    # no prefix caching: the side that runs second would find the prompts cached
    engine = LLMEngine(dataclasses.replace(config, enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    result: dict = {"model": engine.model_id, "dtype": str(engine.dtype).removeprefix("torch."),
                    "attention_backend": engine.backend.name, "num_speculative_tokens": config.num_speculative_tokens,
                    "speculative_max_step_tokens": config.speculative_max_step_tokens,
                    "speculative_policy": config.speculative_policy,
                    "max_tokens": max_tokens, "torch_threads": torch.get_num_threads(),
                    "workloads": {}}
    same = total = 0
    for name, (source, prompts) in workloads(num_prompts).items():
        if names and name not in names:
            continue
        answers = {}
        if source == "cache":       # the answers served before, sampled at another temperature
            earlier = engine.generate(prompts, SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=1),
                                      chat=True)
            answers = {p: o.token_ids for p, o in zip(prompts, earlier, strict=True)}
        rows, greedy = {}, None
        for batch in batch_sizes:
            best, rates = {}, {"off": [], "on": []}
            for _ in range(repeats):
                for side in ("off", "on"):
                    drafter = DraftProposer((source,), config.num_speculative_tokens, engine.max_model_len,
                                            config.speculative_policy) if side == "on" else None
                    outs, seconds, decoded = run_batches(engine, batches_of(prompts, batch), params, drafter, answers)
                    rates[side].append(decoded / seconds)
                    if side not in best or seconds < best[side][1]:
                        best[side] = (outs, seconds, decoded, drafter)
            (plain, t_off, n_off, _), (drafted, t_on, n_on, drafter) = best["off"], best["on"]
            if greedy is None:          # the first batch size's plain outputs, in prompt order (batches_of)
                greedy = [o.token_ids for o in plain[:len(prompts)]]
            equal = sum(a.token_ids == b.token_ids for a, b in zip(plain, drafted, strict=True))
            same, total = same + equal, total + len(plain)
            stats = drafter.totals[source]
            rows[str(batch)] = {
                "decode_tok_s_off": round(n_off / t_off, 2), "decode_tok_s_on": round(n_on / t_on, 2),
                "speedup": round((n_on / t_on) / (n_off / t_off), 3),
                # each repeat's on / off pair (run back to back): how far one pair alone could be off on a busy host
                "speedup_per_repeat": [round(on / off, 3) for off, on in zip(rates["off"], rates["on"], strict=True)],
                "itl_ms_off": round(1000 * t_off * batch / n_off, 2), "itl_ms_on": round(1000 * t_on * batch / n_on, 2),
                "requests": len(plain), "output_tokens": sum(len(o.token_ids) for o in plain),
                "identical": equal / len(plain),
                "acceptance": round(stats.accepted_tokens / stats.proposed_tokens, 3) if stats.proposed_tokens else 0.0,
                "drafts": stats.drafts, "proposed_tokens": stats.proposed_tokens,
                "accepted_tokens": stats.accepted_tokens, "steps_saved": stats.steps_saved,
            }
        first = rows[str(batch_sizes[0])]
        result["workloads"][name] = {"source": source, "speedup_batch1": first["speedup"] if batch_sizes[0] == 1
                                     else None, "acceptance": first["acceptance"], "batches": rows}
        if source == "ngram":
            prompt_ids = [engine.inputs.make_sequence(p, params, chat=True).token_ids for p in prompts]
            result["workloads"][name]["ngram_ceiling"] = prompt_lookup_ceiling(prompt_ids, greedy,
                                                                               config.num_speculative_tokens)
    result["identical"] = same / total if total else None
    result["machine"] = machine_note(load_at_start)
    result["cpu_flags"] = cpu_flags()
    return result


def cpu_flags() -> list[str]:
    """The vector extensions that decide CPU speed (the full flag list is long)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "fma", "sse4", "amx", "f16c")))


def plot_spec(result: dict, path: Path) -> None:
    """Speedup (decode tok/s with drafts / without) per workload, one bar per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    batches = list(next(iter(result["workloads"].values()))["batches"]) if names else []
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(batches))
    for j, batch in enumerate(batches):
        values = [result["workloads"][n]["batches"][batch]["speedup"] for n in names]
        ax.bar([i + j * width for i in range(len(names))], values, width, label=f"batch {batch}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.5, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(names))],
                  [f"{n}\n({result['workloads'][n]['source']}, acc {result['workloads'][n]['acceptance']:.2f})"
                   for n in names])
    ax.set_ylabel("decode tok/s with drafts / without")
    ax.set_title(f"Speculative decoding, {result['model']} {result['dtype']} (identical: {result['identical']:.0%})")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
