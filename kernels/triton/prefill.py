"""Triton paged prefill attention: chunks of new tokens against their cached prefix plus themselves, causally."""

import torch
import triton
import triton.language as tl

from strata.kernels.metadata import AttentionMetadata, LayerKV
from strata.kernels.triton.kv_tiles import (
    LOG2E,
    dot_precision,
    head_block,
    load_kv_tiles,
    online_softmax_step,
    scale_args,
)

BLOCK_M = 64  # rows per program: (query token, query head of the group) pairs, so GQA heads share K/V loads
BLOCK_N = 32


@triton.jit
def _prefill_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, context_lens, out,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (sequence, kv head, row tile). Row r of the chunk is query token r // GROUP, head r % GROUP of the
    group; query j sits at position context_len - q_len + j and sees keys 0..that position."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    context_len = tl.load(context_lens + seq)
    prefix_len = context_len - q_len
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_valid = tokens < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_valid[:, None] & d_mask[None, :]
    qt = tl.load(q + (q_start + tokens)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                 mask=io_mask, other=0.0).to(tl.float32)
    qt = qt * (scale * LOG2E)  # the softmax below runs in base 2
    q_pos = prefix_len + tokens
    last_token = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = tl.where(tile * BLOCK_M // GROUP < q_len, prefix_len + last_token + 1, 0)  # causal bound of the tile
    table = block_tables + seq * stride_bt
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kv_tile in range(0, kv_end, BLOCK_N):
        positions = kv_tile + tl.arange(0, BLOCK_N)
        valid = positions < kv_end
        k, v = load_kv_tiles(k_cache, v_cache, k_scale, v_scale, table, positions, valid, kv_head, offs_d, d_mask,
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                             stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                             BLOCK_SIZE, QUANTIZED)
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION)
        s = tl.where(valid[None, :] & (positions[None, :] <= q_pos[:, None]), s, float("-inf"))
        # m is finite after the first tile: key 0 is visible to every query
        m, l, acc = online_softmax_step(s, v, m, l, acc, PRECISION)
    acc = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(out + (q_start + tokens)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], acc,
             mask=io_mask)


def paged_prefill_attention(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D] of the prefill chunks -> [T, Hq, D]; same contract as the torch reference."""
    out = torch.empty_like(q)
    cu = meta.prefill_cu_seqlens_q_host
    if q.shape[0] == 0 or meta.num_prefills == 0:
        return out
    assert q.stride(-1) == kv.k.stride(-1) == kv.v.stride(-1) == 1, "head_dim must be contiguous"
    assert meta.prefill_block_tables.stride(-1) == 1, "block-table rows must be contiguous"
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = kv.k.shape[2], kv.k.shape[1]
    group = num_heads // num_kv_heads
    max_q_len = max(end - start for start, end in zip(cu, cu[1:], strict=False))  # host ints: no device sync
    k_scale, *k_scale_strides = scale_args(kv.k_scale)
    v_scale, *v_scale_strides = scale_args(kv.v_scale)
    grid = (meta.num_prefills, num_kv_heads, triton.cdiv(max_q_len * group, BLOCK_M))
    _prefill_kernel[grid](
        q, kv.k, kv.v, k_scale, v_scale, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
        meta.prefill_context_lens, out,
        scale,
        q.stride(0), q.stride(1), *kv.k.stride()[:3], *kv.v.stride()[:3], *k_scale_strides, *v_scale_strides,
        meta.prefill_block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_block(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, QUANTIZED=kv.quantized, PRECISION=dot_precision(q, kv.k),
        num_warps=8,  # fp32 [64, BLOCK_D] tiles: with 4 warps the sm_90 build spills (fp32, head_dim 128)
    )
    return out
