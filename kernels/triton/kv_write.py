"""Triton KV write: scatter the new tokens' K/V into their cache slots, quantizing to INT8 when asked."""

import torch
import triton
import triton.language as tl

from strata.kernels.metadata import LayerKV
from strata.kernels.triton.kv_tiles import scale_args


@triton.jit
def _round_half_even(x):
    """torch.round semantics (ties to even), which the interpreter and every GPU can run without libdevice."""
    r = tl.floor(x)
    frac = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def _store_rows(src, dst, scales, scale_offsets, mask, row_mask, QUANTIZED: tl.constexpr):
    """Copy one token's [heads, head_dim] tile; INT8: symmetric, one fp16 scale per head row = absmax / 127,
    rounded to fp16 before dividing, exactly as torch_reference.quantize_int8 (IEEE division, ties to even)."""
    if QUANTIZED:
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-5), 127.0).to(tl.float16).to(tl.float32)
        q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, scale[:, None])), -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scales + scale_offsets, scale, mask=row_mask)
    else:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


@triton.jit
def _write_kv_kernel(
    key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr,
):
    """One program per token, all its KV heads at once; negative slots (padding) are skipped."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (heads < NUM_HEADS) & (slot >= 0)
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    _store_rows(key + token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :],
                k_cache + block * stride_kcb + offset * stride_kct + heads[:, None] * stride_kch + offs_d[None, :],
                k_scale, block * stride_ksb + offset * stride_kst + heads * stride_ksh, mask, row_mask, QUANTIZED)
    _store_rows(value + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :],
                v_cache + block * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch + offs_d[None, :],
                v_scale, block * stride_vsb + offset * stride_vst + heads * stride_vsh, mask, row_mask, QUANTIZED)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, H, D], any row strides) into their slots; same contract as the torch reference."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == value.stride(-1) == kv.k.stride(-1) == kv.v.stride(-1) == 1, "head_dim must be contiguous"
    k_scale, *k_scale_strides = scale_args(kv.k_scale)
    v_scale, *v_scale_strides = scale_args(kv.v_scale)
    _write_kv_kernel[(num_tokens,)](
        key, value, kv.k, kv.v, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv.k.stride()[:3], *kv.v.stride()[:3], *k_scale_strides, *v_scale_strides,
        NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv.k.shape[1], QUANTIZED=kv.quantized,
    )
