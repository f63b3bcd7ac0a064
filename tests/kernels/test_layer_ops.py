"""The fused CPU layer ops (cpu/pointwise.cpp) against float64 math and against the torch ops they replace: RMSNorm,
the residual seam, rotary embedding on strided views of a fused qkv row, SwiGLU; other dtypes fall back to torch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.kernels.layer_ops import CPU_OPS, TORCH_OPS


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return (weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)).float()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), hidden=st.sampled_from([8, 96, 576, 1000]), seed=st.integers(0, 2**16))
def test_norms_match_float64_math_and_the_torch_ops(rows, hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    expected = rms_norm64(x, weight, 1e-5)
    torch.testing.assert_close(CPU_OPS.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(TORCH_OPS.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)
    total = x + residual
    mine = residual.clone()
    normed, new_residual = CPU_OPS.add_rms_norm(x, mine, weight, 1e-6)
    assert new_residual is mine and torch.equal(mine, total)          # updated in place, same sum as x + residual
    torch.testing.assert_close(normed, rms_norm64(total, weight, 1e-6), rtol=1e-5, atol=1e-5)
    ref_normed, ref_residual = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(ref_residual, total)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (2, 1, 128)])
def test_rope_rotates_strided_q_and_k_views_in_place_like_the_torch_op(heads, kv_heads, dim):
    tokens = 7
    gen = torch.Generator().manual_seed(heads * dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def views(t):
        q, k, v = t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v

    q, k, v = views(qkv.clone())
    ref_q, ref_k = TORCH_OPS.rope(*views(qkv.clone())[:2], cos, sin)
    v_before = v.clone()
    out_q, out_k = CPU_OPS.rope(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()     # in place
    torch.testing.assert_close(out_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before)                                   # the value columns beside them untouched
    # the rotation keeps each pair's length: a check that does not lean on the torch op
    pairs = lambda t: t[..., : dim // 2] ** 2 + t[..., dim // 2:] ** 2      # noqa: E731
    torch.testing.assert_close(pairs(out_q), pairs(views(qkv)[0]), rtol=1e-4, atol=1e-4)


def test_silu_mul_matches_the_definition():
    gate_up = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(1)) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = (gate / (1 + torch.exp(-gate)) * up).float()
    torch.testing.assert_close(CPU_OPS.silu_mul(gate_up), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(TORCH_OPS.silu_mul(gate_up), expected, rtol=1e-5, atol=1e-5)


def test_other_dtypes_take_the_torch_ops():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(CPU_OPS.rms_norm(x, weight, 1e-5), TORCH_OPS.rms_norm(x, weight, 1e-5))
    assert torch.equal(CPU_OPS.silu_mul(x), TORCH_OPS.silu_mul(x))
