"""Compact weights (fp16, Q8_0, Q4_0, Q4_1) match gguf-py's own dequantization, and their matmuls match a
dequantize-then-matmul reference on random shapes, in the row kernel (decode) and the BLAS path (prefill) alike."""
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from torch import nn

from strata.kernels.cpu import build, weight_linear
from strata.models.compact_linear import CompactLinear


def q8_0_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the row kernel quantizes it for Q8_0 weights: per block of 32, scale d = max |x| * (1 / 127) in fp32,
    codes x * (1 / d) rounded half to even; returned as d * codes in float64."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inverse)
    assert codes.abs().max() <= 127
    return (codes.double() * scale.double()).reshape(x.shape)


def kernel_reference(layer: CompactLinear, x: torch.Tensor) -> torch.Tensor:
    """What the layer computes, in float64: the widened weight times x, with x rounded to bf16 for bf16 weights and
    quantized to Q8_0 blocks where the kernel does that for Q8_0 / Q4 weights (weight_linear.quantizes_activations,
    at every batch size)."""
    weight = layer.unpacked_weight()
    if layer.format == "bf16":
        x, weight = x.bfloat16(), weight.bfloat16()
    elif weight_linear.quantizes_activations(layer.format):
        x = q8_0_activations(x)
    out = x.double() @ weight.double().T
    return out if layer.bias is None else out + layer.bias.double()


@pytest.mark.parametrize("block_type", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("out_features, in_features", [(7, 32), (67, 96), (256, 576)])
def test_gguf_blocks_widen_exactly_and_multiply_like_the_reference(block_type, out_features, in_features):
    rng = np.random.default_rng(out_features)
    weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    blocks = quants.quantize(weight, block_type)
    bias = torch.randn(out_features)
    layer = CompactLinear.from_blocks(blocks, block_type, in_features, bias)
    reference = torch.from_numpy(quants.dequantize(blocks, block_type).copy())
    assert torch.equal(layer.unpacked_weight(), reference)       # same rounding as gguf-py, bit for bit
    for rows in (1, 2, 3, 4, 5, 8, 17, weight_linear.KERNEL_MAX_ROWS + 7, 70):
        x = torch.randn(rows, in_features)
        torch.testing.assert_close(layer(x).double(), kernel_reference(layer, x), rtol=1e-5, atol=1e-5)


def test_f16_and_float_quantization_keep_the_layer_close():
    torch.manual_seed(0)
    linear = nn.Linear(320, 130, bias=False).requires_grad_(False)
    x = torch.randn(2, 5, 320)
    exact = linear(x)
    for weight_format, tol in (("f16", 1e-3), ("int8", 2e-2), ("int4", 2e-1)):
        layer = CompactLinear.from_linear(linear, weight_format)
        out = layer(x)
        assert out.shape == exact.shape
        torch.testing.assert_close(out.double(), kernel_reference(layer, x.view(-1, 320)).view(out.shape),
                                   rtol=1e-5, atol=1e-5)
        assert (out - exact).abs().max() < tol * exact.abs().max()
    bf16 = CompactLinear.from_linear(linear, "int8")(x.bfloat16())
    assert bf16.dtype == torch.bfloat16


def test_bad_blocks_are_refused_clearly():
    blocks = quants.quantize(np.zeros((4, 64), np.float32), Q.Q8_0)
    with pytest.raises(ValueError, match="do not hold"):
        CompactLinear.from_blocks(blocks, Q.Q8_0, 96)
    with pytest.raises(ValueError, match="cannot stay compact"):
        CompactLinear.from_blocks(blocks, Q.Q4_K, 64)
    with pytest.raises(ValueError, match="divisible by 32"):
        CompactLinear.from_linear(nn.Linear(40, 8), "int8")


@pytest.mark.parametrize("out_features", [4, 130, 577])
def test_f16_rows_widened_in_registers_match_the_reference_at_every_batch_size(out_features):
    """The fp16 kernel per batch size (the row stream below 8 rows, one pass on AVX2 builds and 4 rows a pass on
    AVX-512 ones; 3 x 4 tiles from 8 rows, with a last group of 1 or 2 activation rows) and a last partial weight
    tile."""
    torch.manual_seed(out_features)
    linear = nn.Linear(576, out_features, bias=False).requires_grad_(False)
    layer = CompactLinear.from_linear(linear, "f16")
    reference = layer.unpacked_weight().double()
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, weight_linear.KERNEL_MAX_ROWS):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(layer(x).double(), x.double() @ reference.T, rtol=1e-5, atol=1e-5)


def test_activation_codes_at_rounding_ties_match_the_reference():
    """An activation whose x / d lies within an ulp of a .5 tie gets the reference's code: 1 / (max |x| * (1 / 127))
    computed as written, not as 127 / max |x|, whose last bit differs (-ffast-math once did that; about one random
    8-row batch in 700 then failed)."""
    if not weight_linear.quantizes_activations("q8"):
        pytest.skip("this build multiplies Q8_0 weights by fp32 activations")
    rng = np.random.default_rng(5)
    rows = []
    while len(rows) < 8:
        amax = np.float32(rng.uniform(0.5, 4.0))
        as_written, rewritten = np.float32(1) / (amax * np.float32(1 / 127)), np.float32(127) / amax
        for code in range(1, 127):
            tie = np.float32((code + 0.5) / as_written)
            for v in (np.nextafter(tie, np.float32(-np.inf)), tie, np.nextafter(tie, np.float32(np.inf))):
                if np.rint(v * as_written) != np.rint(v * rewritten) and len(rows) < 8:
                    rows.append([amax, v] + [0.0] * 30)
    x = torch.tensor(rows, dtype=torch.float32)
    weight = torch.eye(32) * 127    # Q8_0 holds it exactly (d = 1, code 127): output j = 127 * d_x * code_j
    layer = CompactLinear.from_blocks(quants.quantize(weight.numpy(), Q.Q8_0), Q.Q8_0, 32, None)
    assert torch.equal(layer.unpacked_weight(), weight)
    torch.testing.assert_close(layer(x).double(), q8_0_activations(x) * 127, rtol=1e-6, atol=0)


@pytest.mark.parametrize("in_features", [576, 544])
@pytest.mark.parametrize("weight_format", ["f16", "bf16", "int8", "int4"])
def test_a_row_gets_the_same_bits_whatever_it_is_batched_with(weight_format, in_features):
    """Every batch size runs the same operations in the same order per output (streamed rows at 1-2 sequences, tiles
    above; a last partial tile at 130 outputs; Q8_0 / Q4 on AVX-512 VNNI: one row at a time below 6 rows, 16 rows
    interleaved from 6, two groups of 16 a pass against 4 weight rows, a last group interleaved or row by row, 18 or
    17 blocks a row): a sequence's logits never depend on its batch neighbours. Q8_0 / Q4 keep that at prefill sizes
    too (the float formats hand those to BLAS)."""
    torch.manual_seed(1)
    layer = CompactLinear.from_linear(nn.Linear(in_features, 130, bias=False).requires_grad_(False), weight_format)
    every_batch = weight_linear.quantizes_activations(layer.format)
    x = torch.randn(75 if every_batch else weight_linear.KERNEL_MAX_ROWS, in_features)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 24, weight_linear.KERNEL_MAX_ROWS) + ((40, 53, 75) if every_batch else ()):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_weights_multiply_bf16_rounded_activations_in_both_paths(monkeypatch, amx):
    """The kernel (AVX512_BF16 dot products, or the fp32 fallback) and the prefill path (BLAS over the widened weight,
    or oneDNN's bf16 matmul where the CPU has AMX) both compute bf16 weights times activations rounded to bf16, summed
    in fp32; the AMX path rounds its outputs to bf16 (one bf16 step: 2**-8 relative). oneDNN's bf16 matmul runs on
    any CPU, so both sides are checked everywhere."""
    monkeypatch.setattr(weight_linear, "AMX", amx)
    torch.manual_seed(2)
    linear = nn.Linear(576, 130, bias=True).requires_grad_(False)
    layer = CompactLinear.from_linear(linear, "bf16")
    assert layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.unpacked_weight(), linear.weight.bfloat16().float())
    for rows in (1, 2, 3, 5, 17, weight_linear.KERNEL_MAX_ROWS + 7):
        x = torch.randn(rows, 576)
        want = kernel_reference(layer, x)
        if amx and rows > weight_linear.KERNEL_MAX_ROWS:        # rounded before the bias is added
            product = want - linear.bias.double()
            assert ((layer(x).double() - want).abs() <= 2 ** -8 * product.abs() + 1e-5).all()
        else:
            torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_compact_weights_are_refused_on_cuda_with_the_reason():
    """The Triton kernel exists (kernels/triton/weight_linear.py) but the engine refuses it until its CUDA-graph test
    passes; dense weights stay the default there."""
    from strata.server.engine.config import EngineConfig

    cuda = torch.device("cuda")
    for quantization in ("int8", "int4", "gguf", "bf16"):
        with pytest.raises(ValueError, match="CPU only.*--dtype bf16"):
            EngineConfig(quantization=quantization).resolve_weight_format(cuda)
    assert EngineConfig().resolve_weight_format(cuda)[0] == "none"


# The instruction-set macros kernels/cpu/*.cpp branch on beyond haswell's AVX2 / FMA / F16C (cpuinfo names).
_BEYOND_HASWELL = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni"}


def build_for_march(march: str):
    """The kernels built for `march`; on a CPU whose native build takes haswell's branches (AVX2, no AVX-512 or
    VNNI), that build itself: a second compile of the same code paths costs CI about 100 s on 2 cores."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    if march == "haswell" and {"avx2", "fma", "f16c"} <= flags and not flags & _BEYOND_HASWELL:
        return build.build_kernels()
    return build.build_for_march(march)


def test_the_avx2_builds_fp16_rows_match_the_reference_and_keep_their_bits_at_every_batch():
    """The AVX2 build's fp16 kernel (below 8 rows one pass of the row stream, from 8 rows 3 x 4 tiles; the native
    build of an AVX-512 CI machine, 4 rows a pass and 16-lane tiles): each output still one chain over k, so the same
    bits alone or batched."""
    if "avx2" not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip("needs a CPU with avx2")
    module = build_for_march("haswell")
    torch.manual_seed(2)
    layer = CompactLinear.from_linear(nn.Linear(576, 130, bias=False).requires_grad_(False), "f16")
    empty = torch.empty(0)
    x = torch.randn(weight_linear.KERNEL_MAX_ROWS, 576)
    alone = torch.cat([module.linear(x[i:i + 1], layer.weight, empty, empty, weight_linear.FORMATS["f16"], 576) for i in range(len(x))])
    torch.testing.assert_close(alone.double(), x.double() @ layer.unpacked_weight().double().T, rtol=1e-5, atol=1e-5)
    for rows in (2, 5, 7, 8, 9, 10, 13, 16, 17, weight_linear.KERNEL_MAX_ROWS):
        assert torch.equal(module.linear(x[:rows], layer.weight, empty, empty, weight_linear.FORMATS["f16"], 576), alone[:rows]), rows


@pytest.mark.parametrize("march, flag", [
    ("haswell", "avx2"),          # AVX2 integer dot products (maddubs + madd, Q8_0 by the sign trick)
    ("alderlake", "avx_vnni"),    # 256-bit VNNI (Q8_0 against activations offset to unsigned)
])
def test_builds_without_avx512_quantize_activations_like_the_reference(march, flag):
    """Code paths a CI machine with AVX-512 never runs in its own build."""
    if flag not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"needs a CPU with {flag}")
    module = build_for_march(march)
    assert module.quantized_dot()
    rng = np.random.default_rng(3)
    for (block_type, code), k in itertools.product(((Q.Q8_0, 1), (Q.Q4_1, 2)), (96, 544)):   # 3 and 17 blocks a row
        weight = (rng.standard_normal((67, k)) * 0.05).astype(np.float32)
        layer = CompactLinear.from_blocks(quants.quantize(weight, block_type), block_type, k, None)
        scales = layer.scales
        mins = layer.mins if layer.mins is not None else torch.empty(0)
        x = torch.randn(45, k)
        alone = torch.cat([module.linear(x[i:i + 1], layer.weight, scales, mins, code, k) for i in range(len(x))])
        want = q8_0_activations(x) @ layer.unpacked_weight().double().T
        torch.testing.assert_close(alone.double(), want, rtol=1e-5, atol=1e-5)
        for rows in (3, 4, 8, 13, 32, 45):   # one row at a time, rows interleaved (8 a group), groups 2 a pass
            assert torch.equal(module.linear(x[:rows], layer.weight, scales, mins, code, k), alone[:rows]), (k, rows)
