"""bf16 prefill on AMX tiles (oneDNN) against widening bf16 weights to fp32 for BLAS, on a CPU with AMX: prefill
tokens/s of 8 long prompts (best of 3, sides alternating), the first generated tokens, and perplexity of the
public-domain text and greedy agreement on the 32 prompts for bf16 weights each way against dense fp32.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/amx_prefill.py --out benchmarks/results/cpu_profile/amx_prefill.json
"""
import argparse
import json
import time
from pathlib import Path

import torch

from strata.kernels.cpu import weight_linear
from strata.server.bench.data_files import packaged
from strata.server.bench.kv import machine_note
from strata.server.bench.spec import cpu_flags
from strata.server.bench.weights import run_weight_accuracy
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams

SIDES = {"widen_fp32": False, "amx_bf16": True}


def prefill_speed(repeats: int = 3) -> dict:
    engine = LLMEngine(EngineConfig(enable_prefix_caching=False))
    text = packaged("public_domain_en.txt").read_text()
    prompts = [text[i * 3000:i * 3000 + 1500] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=1)
    tokens = sum(len(engine.inputs.make_sequence(p, params, chat=False).token_ids) for p in prompts)
    seconds, first = {side: [] for side in SIDES}, {}
    for _ in range(repeats):
        for side, amx in SIDES.items():
            weight_linear.AMX = amx
            start = time.perf_counter()
            outs = engine.generate(prompts, params, chat=False)
            seconds[side].append(round(time.perf_counter() - start, 3))
            first[side] = [o.token_ids for o in outs]
    return {"prompts": len(prompts), "prompt_tokens": tokens, "seconds": seconds,
            "prefill_tok_s": {side: round(tokens / min(s)) for side, s in seconds.items()},
            "same_first_tokens": first["widen_fp32"] == first["amx_bf16"],
            "weights": f"{engine.dtype} activations, bf16 weights (--dtype auto)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cpu._is_amx_tile_supported():
        raise SystemExit("this CPU has no AMX tiles: nothing to compare")
    load = __import__("os").getloadavg()
    amx_default = weight_linear.AMX
    result = {"prefill": prefill_speed()}
    for side, amx in SIDES.items():
        weight_linear.AMX = amx
        acc = run_weight_accuracy(EngineConfig(), formats=("bf16",))
        result[f"accuracy_{side}"] = {"ppl": acc["ppl"], "ppl_increase_pct_vs_fp32": acc["ppl_increase_pct_vs_fp32"],
                                      "greedy_vs_fp32": acc["greedy_vs_fp32"]}
    weight_linear.AMX = amx_default
    result |= {"threads": torch.get_num_threads(), "cpu_flags": cpu_flags(), "machine": machine_note(load)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
