"""Triton W8A16 / W4A16 kernel against gguf-py's own dequantization of the same blocks, multiplied in float64.

Runs on CPU under TRITON_INTERPRET=1 (set by conftest), or on CUDA when TRITON_INTERPRET=0 (benchmarks/gpu_check.sh).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

pytest.importorskip("triton")

from helpers.triton_device import DEVICE, needs_triton_device  # noqa: E402

from strata.kernels.triton.weight_linear import TileConfig, linear  # noqa: E402
from strata.models.compact_linear import CompactLinear  # noqa: E402

pytestmark = needs_triton_device
# activation dtype -> max error relative to the output's largest value (bf16/fp16 round the widened weights)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


def quantized(block_type: Q, out_features: int, in_features: int, seed: int) -> tuple[CompactLinear, torch.Tensor]:
    """A compact layer on DEVICE and the float64 weight its blocks stand for, as gguf-py dequantizes them."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(0.0, 0.05, (out_features, in_features)).astype(np.float32)
    weight[:, : in_features // 3] += 0.03                  # groups of all-positive values give Q4_1 a real minimum
    blocks = quants.quantize(weight, block_type)
    layer = CompactLinear.from_blocks(blocks, block_type, in_features).to(DEVICE)
    return layer, torch.from_numpy(quants.dequantize(blocks, block_type).copy()).double()


@pytest.mark.parametrize("block_type", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 40, 96), (5, 96, 64), (19, 33, 160)])
def test_matches_the_dequantized_matmul(block_type, dtype, rows, out_features, in_features):
    """Shapes cover partial M, N and K tiles (N and M not multiples of the tile, K not a multiple of block_k)."""
    layer, reference_weight = quantized(block_type, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(out_features)).to(dtype)
    out = linear(x.to(DEVICE), layer.format, layer.weight, layer.scales, layer.mins, in_features)
    expected = x.double() @ reference_weight.T
    assert out.dtype == dtype and out.shape == (rows, out_features)
    error = (out.cpu().double() - expected).abs().max() / expected.abs().max()
    assert error < TOLERANCE[dtype], (block_type.name, dtype, float(error))


@pytest.mark.parametrize("config", [TileConfig(16, 16, 32), TileConfig(32, 64, 64, num_warps=2, num_stages=2),
                                    TileConfig(16, 32, 64, split_k=3), TileConfig(16, 16, 32, split_k=7)])
def test_every_tile_config_gives_the_same_product(config):
    """The benchmark sweeps tile configs: each must compute the same thing, over leading batch dimensions too; K
    splits (fp32 partials summed after) include uneven ones (224 columns in 3 splits of 128 / 96, or 7 of 32)."""
    layer, reference_weight = quantized(Q.Q4_1, 48, 224, seed=7)
    x = torch.randn(2, 3, 224, generator=torch.Generator().manual_seed(1))
    out = linear(x.to(DEVICE), layer.format, layer.weight, layer.scales, layer.mins, 224, config)
    expected = x.double() @ reference_weight.T
    assert out.shape == (2, 3, 48) and out.dtype == x.dtype
    assert torch.allclose(out.cpu().double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_other_formats_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="q8, q4"):
        linear(torch.zeros(1, 32), "f16", torch.zeros(4, 32, dtype=torch.float16), torch.zeros(4, 1), None, 32)
