"""Helpers shared by the Triton paged-attention kernels: gathering K/V tiles through a block table."""

import torch
import triton
import triton.language as tl

# Softmax runs in base 2 (exp2 is one GPU instruction): queries are pre-scaled by LOG2E.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def load_kv_tiles(k_cache, v_cache, k_scale, v_scale, table, positions, valid, kv_head, offs_d, d_mask,
                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                  BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr):
    """K and V of `positions` ([N]) of one sequence, read through its block-table row: two fp32 [N, BLOCK_D] tiles.

    INT8 rows are multiplied by their per-(token, kv-head) scale in registers; invalid positions read as 0.
    """
    block_ids = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # int64: blocks span GBs
    offsets = positions % BLOCK_SIZE
    mask = valid[:, None] & d_mask[None, :]
    k_rows = block_ids * stride_kb + offsets * stride_kt + kv_head * stride_kh
    v_rows = block_ids * stride_vb + offsets * stride_vt + kv_head * stride_vh
    k = tl.load(k_cache + k_rows[:, None] + offs_d[None, :], mask=mask, other=0).to(tl.float32)
    v = tl.load(v_cache + v_rows[:, None] + offs_d[None, :], mask=mask, other=0).to(tl.float32)
    if QUANTIZED:
        k *= tl.load(k_scale + block_ids * stride_ksb + offsets * stride_kst + kv_head * stride_ksh,
                     mask=valid, other=0.0)[:, None]
        v *= tl.load(v_scale + block_ids * stride_vsb + offsets * stride_vst + kv_head * stride_vsh,
                     mask=valid, other=0.0)[:, None]
    return k, v


def dot_precision(q: torch.Tensor, cache: torch.Tensor) -> str:
    """fp32 models need exact fp32 dots; bf16/fp16/INT8 values are exact in tf32, so tensor cores lose nothing."""
    return "ieee" if torch.float32 in (q.dtype, cache.dtype) else "tf32"


def head_block(head_dim: int) -> int:
    """Power-of-two tile width covering head_dim (at least 16, the smallest tl.dot dimension)."""
    return max(16, triton.next_power_of_2(head_dim))


def scale_args(scales: torch.Tensor | None) -> tuple[torch.Tensor | None, int, int, int]:
    """(pointer, strides) of an INT8 scale view, or (None, 0, 0, 0) for a float cache."""
    return (scales, *scales.stride()) if scales is not None else (None, 0, 0, 0)


@triton.jit
def online_softmax_step(s, v, m, l, acc, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores s [rows, keys] and values v [keys, D] into the running max m, sum l and
    output acc (flash attention's rescaling); shared by decode and prefill."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    l = l * alpha + tl.sum(p, 1)
    return m_new, l, acc
