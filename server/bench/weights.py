"""`strata bench weight-accuracy`: what compact weights (fp16, bf16, INT8, INT4, the GGUF's own blocks) cost in accuracy
against the dense fp32 model: perplexity on the public-domain text (in prefill chunks, and in chunks of KERNEL_MAX_ROWS
tokens, which run the linears a decode step runs) and greedy agreement on the 32 prompts."""

import dataclasses
import json
import os

import torch

from strata.kernels.cpu.weight_linear import KERNEL_MAX_ROWS
from strata.server.bench.kv import PROMPTS, TEXT, agreement, machine_note, perplexity_and_greedy
from strata.server.engine.config import EngineConfig
from strata.server.engine.sampling_params import SamplingParams

FORMATS = ("f16", "bf16", "int8", "int4", "gguf")


def run_weight_accuracy(config: EngineConfig, formats: tuple[str, ...] = FORMATS, max_tokens: int = 64,
                        text_tokens: int | None = None, num_prompts: int | None = None) -> dict:
    """Each weight format on a fresh engine (fp32 math) against dense fp32 weights; text_tokens and num_prompts
    (None = all) shorten the run."""
    prompts = json.loads(PROMPTS.read_text())
    chat, raw = prompts["chat"][:num_prompts], prompts["raw"][:num_prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    load_at_start = os.getloadavg()
    configs = {weights: dataclasses.replace(config, dtype="fp32", quantization=weights) for weights in ("none", *formats)}
    ppl, ppl_decode, tokens, scored = perplexity_and_greedy(configs, chat, raw, params, text_tokens,
                                                            decode_chunk=KERNEL_MAX_ROWS)
    return {
        "ppl": ppl,
        "ppl_increase_pct_vs_fp32": {f: round((ppl[f] / ppl["none"] - 1) * 100, 3) for f in formats},
        "ppl_decode_path": ppl_decode,
        "ppl_decode_path_increase_pct_vs_fp32": {f: round((ppl_decode[f] / ppl_decode["none"] - 1) * 100, 3)
                                                 for f in formats},
        "greedy_vs_fp32": {f: agreement(tokens["none"], tokens[f]) for f in formats},
        "settings": {"text": f"server/bench/data/{TEXT.name}", "text_tokens": scored,
                     "prompts": f"{len(chat)} chat (chat template) + {len(raw)} raw (server/bench/data/{PROMPTS.name})",
                     "max_tokens": max_tokens, "greedy": True, "ignore_eos": True, "math": "fp32",
                     "formats": {"none": "dense fp32", "f16": "fp16 weights",
                                 "bf16": "bf16 weights, activations rounded to bf16 in the dot products", "int8": "Q8_0 blocks of 32 (gguf-py); the activations are "
                                 "quantized to Q8_0 blocks too (prefill and decode) where the CPU has int8 dot products",
                                 "int4": "Q4_1 blocks of 32 (gguf-py), lm_head Q8_0 (as int8)", "gguf": "the model's .gguf blocks as stored"},
                     "threads": torch.get_num_threads(), "machine_note": machine_note(load_at_start)},
    }
