"""Triton KV write: scatter the new tokens' K/V into their cache slots, quantizing to INT8 when asked."""

import torch
import triton
import triton.language as tl

from strata.kernels.metadata import LayerKV
from strata.kernels.triton_paged import head_block, scale_args


@triton.jit
def _round_half_even(x):
    """torch.round semantics (ties to even), which the interpreter and every GPU can run without libdevice."""
    r = tl.floor(x)
    frac = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def _store_row(src, dst, scales, scale_offset, offs_d, d_mask, valid, QUANTIZED: tl.constexpr):
    """Copy one head's row; INT8: symmetric, scale = absmax / 127 (as torch_reference.quantize_int8)."""
    if QUANTIZED:
        x = tl.load(src + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-8), 127.0)
        q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, scale)), -127.0), 127.0)
        tl.store(dst + offs_d, q.to(tl.int8), mask=d_mask & valid)
        tl.store(scales + scale_offset, scale, mask=valid)
    else:
        tl.store(dst + offs_d, tl.load(src + offs_d, mask=d_mask), mask=d_mask & valid)


@triton.jit
def _write_kv_kernel(
    key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr,
):
    """One program per (token, kv head); negative slots (padding) are skipped."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    valid = slot >= 0
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    _store_row(key + token * stride_kt + head * stride_kh,
               k_cache + block * stride_kcb + offset * stride_kct + head * stride_kch,
               k_scale, block * stride_ksb + offset * stride_kst + head * stride_ksh,
               offs_d, d_mask, valid, QUANTIZED)
    _store_row(value + token * stride_vt + head * stride_vh,
               v_cache + block * stride_vcb + offset * stride_vct + head * stride_vch,
               v_scale, block * stride_vsb + offset * stride_vst + head * stride_vsh,
               offs_d, d_mask, valid, QUANTIZED)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, H, D], any row strides) into their slots; same contract as the torch reference."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == value.stride(-1) == kv.k.stride(-1) == kv.v.stride(-1) == 1, "head_dim must be contiguous"
    k_scale, *k_scale_strides = scale_args(kv.k_scale)
    v_scale, *v_scale_strides = scale_args(kv.v_scale)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, kv.k, kv.v, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv.k.stride()[:3], *kv.v.stride()[:3], *k_scale_strides, *v_scale_strides,
        HEAD_DIM=head_dim, BLOCK_D=head_block(head_dim), BLOCK_SIZE=kv.k.shape[1], QUANTIZED=kv.quantized,
    )
