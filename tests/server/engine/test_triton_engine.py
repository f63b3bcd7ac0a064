"""The engine on the Triton backend (run by the interpreter on CPU) emits the same greedy tokens as on torch."""

import os
import random

import pytest

pytest.importorskip("triton")

from strata.server.engine.config import EngineConfig  # noqa: E402
from strata.server.engine.llm_engine import LLMEngine  # noqa: E402
from strata.server.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def greedy_tokens(name: str, kv_dtype: str, backend: str, first: list[int], rest: list[list[int]]) -> list[list[int]]:
    """`first` runs alone, so `rest` (which shares its prefix) starts from cached blocks; small token budget per
    step, so long prompts are prefilled in chunks next to decoding sequences."""
    engine = LLMEngine(EngineConfig(model=None, load_format="dummy", model_config=name, dtype="fp32",
                                    kv_dtype=kv_dtype, block_size=8, max_num_seqs=8, max_num_batched_tokens=24,
                                    kv_cache_memory="8MiB", attention_backend=backend, device="cpu"))
    assert engine.backend.name == ("torch" if backend == "torch" else "triton")
    for layer in engine.model.model.layers:  # dummy weights give near-uniform attention: make the scores O(1)
        layer.self_attn.qkv_proj.weight.mul_(8.0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = engine.generate([first], params) + engine.generate(rest, params)
    assert engine.block_manager.stats.hit_tokens >= 16  # rest[0] really started from first's cached blocks
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("name,kv_dtype", [("tiny-llama", "fp32"), ("tiny-qwen2", "int8")])
def test_triton_interpreter_engine_matches_torch(name, kv_dtype):
    rng = random.Random(11)
    shared = [rng.randrange(3, 512) for _ in range(19)]  # ends mid-block
    first = shared + [rng.randrange(3, 512) for _ in range(4)]
    rest = [shared + [rng.randrange(3, 512) for _ in range(6)]] + [
        [rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 40)]
    expected = greedy_tokens(name, kv_dtype, "torch", first, rest)
    assert greedy_tokens(name, kv_dtype, "triton-interpret", first, rest) == expected
