"""Prepacked bf16 linears (the CPU default dtype's fast path) give exactly F.linear's results, in the engine too."""

import pytest
import torch
from torch import nn

from strata.models import loader
from strata.models.packed_linear import PackedLinear, can_pack
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU has no native bf16 in oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_to_f_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(576, 1000, bias=bias).to(torch.bfloat16).requires_grad_(False)
    packed = PackedLinear(linear)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        assert torch.equal(packed(x), nn.functional.linear(x, linear.weight, linear.bias))
    assert torch.equal(packed.unpacked_weight(), linear.weight)


def engine_tokens(monkeypatch, pack: bool) -> tuple[LLMEngine, list[list[int]]]:
    if not pack:
        monkeypatch.setattr(loader, "can_pack", lambda dtype, device: False)
    engine = LLMEngine(EngineConfig(load_format="dummy", model_config="tiny-llama", dtype="bf16", device="cpu",
                                    kv_cache_memory="8MiB", max_num_batched_tokens=64))
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return engine, [o.token_ids for o in outs]


def test_bf16_engine_packs_every_linear_and_keeps_its_tokens(monkeypatch):
    packed_engine, packed_tokens = engine_tokens(monkeypatch, pack=True)
    modules = list(packed_engine.model.modules())
    assert not any(isinstance(m, nn.Linear) for m in modules)
    assert sum(isinstance(m, PackedLinear) for m in modules) == 1 + 4 * packed_engine.model_config.num_layers
    plain_engine, plain_tokens = engine_tokens(monkeypatch, pack=False)
    assert any(isinstance(m, nn.Linear) for m in plain_engine.model.modules())
    assert packed_tokens == plain_tokens
