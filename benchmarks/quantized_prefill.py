"""Prefill speed of Q8_0 / Q4 weights (--quantization int8 / gguf): prompt tokens/s of a few prompt shapes, best of
3, max_tokens 1, prefix caching off. Run it under two checkouts to compare them (PYTHONPATH=a folder whose `strata`
is the other checkout, and its own TORCH_EXTENSIONS_DIR so the two kernel builds do not replace each other).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quantized_prefill.py --quantization int8 gguf
"""
import argparse
import json
import os
import time

import torch

import strata
from strata.server.bench.data_files import packaged
from strata.server.bench.kv import cpu_isa, cpu_name
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams

# (prompts, characters each): four short chat-sized prompts arriving together, and eight long ones
SHAPES = {"4 x ~64 tokens": (4, 300), "8 x ~330 tokens": (8, 1500)}


def prefill(engine: LLMEngine, prompts: list[str], repeats: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=1)
    tokens = sum(len(engine.inputs.make_sequence(p, params, chat=False).token_ids) for p in prompts)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, params, chat=False)
        seconds.append(round(time.perf_counter() - start, 3))
    return {"prompt_tokens": tokens, "seconds": seconds, "prefill_tok_s": round(tokens / min(seconds)),
            "first_tokens": [o.token_ids[0] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantization", nargs="+", default=["int8", "gguf"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    text = packaged("public_domain_en.txt").read_text()
    result = {"cpu": cpu_name(), "isa": cpu_isa(), "threads": torch.get_num_threads(),
              "load_at_start": os.getloadavg(), "checkout": os.path.dirname(strata.__file__), "runs": []}
    for quantization in args.quantization:
        engine = LLMEngine(EngineConfig(quantization=quantization, enable_prefix_caching=False))
        for shape, (count, chars) in SHAPES.items():
            prompts = [text[i * 3000:i * 3000 + chars] for i in range(count)]
            result["runs"].append({"quantization": quantization, "shape": shape,
                                   **prefill(engine, prompts, args.repeats)})
        del engine
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
