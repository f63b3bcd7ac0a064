"""Triton paged decode attention: one query token per sequence, GQA-grouped, split-K (flash-decoding) + merge."""

import functools

import torch
import triton
import triton.language as tl

from strata.kernels.metadata import LayerKV
from strata.kernels.triton.kv_tiles import (
    LOG2E,
    dot_precision,
    head_block,
    load_kv_tiles,
    online_softmax_step,
    scale_args,
)

BLOCK_N = 32  # keys per inner-loop tile, independent of the cache block size
MIN_SPLIT_TOKENS = 128  # shorter splits cost more in the merge than they gain in parallelism
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, out, lse,
    scale, num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid (seq, kv head, split): all GROUP query heads of one KV head read each K/V tile once.

    Each sequence cuts its own context into num_splits tile-aligned pieces, so the grid depends on host shapes only
    (a CUDA graph replays it for any context length) and short and long sequences alike spread over the splits.
    Without SPLIT it writes the normalised output; with SPLIT, the split's normalised partial output and its
    base-2 log-sum-exp (-inf for an empty split) for _merge_kernel.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens + seq)
    split_len = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    offs_g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qt = tl.load(q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                 mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    qt = qt * (scale * LOG2E)  # the softmax below runs in base 2
    table = block_tables + seq * stride_bt
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        valid = positions < end
        k, v = load_kv_tiles(k_cache, v_cache, k_scale, v_scale, table, positions, valid, kv_head, offs_d, d_mask,
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                             stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                             BLOCK_SIZE, QUANTIZED)
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION)
        s = tl.where(valid[None, :], s, float("-inf"))
        # m is finite after the first tile: it holds >= 1 valid key
        m, l, acc = online_softmax_step(s, v, m, l, acc, PRECISION)
    nonempty = l > 0.0
    acc = acc / tl.where(nonempty, l, 1.0)[:, None]
    tl.store(out + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :], acc,
             mask=g_mask[:, None] & d_mask[None, :])
    if SPLIT:
        tl.store(lse + seq * stride_lb + heads * stride_lh + split,
                 tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf")), mask=g_mask)


@triton.jit
def _merge_kernel(
    partial, lse, out, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid (seq, query head): weight each split's output by exp2(lse - max lse); split 0 is never empty."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse_s = tl.load(lse + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse_s - tl.max(lse_s, 0))
    parts = tl.load(partial + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(w[:, None] * parts, 0) / tl.sum(w, 0)
    tl.store(out + seq * stride_ob + head * stride_oh + offs_d, o, mask=d_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Split the context only when (sequence, kv head) programs alone leave SMs idle: ~2 programs per SM."""
    wanted = triton.cdiv(2 * _num_sms(device), batch * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_tokens, MIN_SPLIT_TOKENS), MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]; same contract as the torch reference, context lengths >= 1.

    The context bound comes from block_tables' width (a host shape), so choosing splits never syncs the device and
    the launch is the same for every step a CUDA graph replays.
    """
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    assert q.stride(-1) == kv.k.stride(-1) == kv.v.stride(-1) == 1, "head_dim must be contiguous"
    assert block_tables.stride(-1) == 1, "block-table rows must be contiguous"
    num_kv_heads, block_size = kv.k.shape[2], kv.k.shape[1]
    group = num_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_tokens, q.device)
    block_d = head_block(head_dim)
    if num_splits > 1:
        partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        dst, dst_strides, lse_strides = partial, partial.stride()[:3], lse.stride()[:2]
    else:
        lse, dst, dst_strides, lse_strides = None, out, (*out.stride()[:2], 0), (0, 0)
    k_scale, *k_scale_strides = scale_args(kv.k_scale)
    v_scale, *v_scale_strides = scale_args(kv.v_scale)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, kv.k, kv.v, k_scale, v_scale, block_tables, context_lens, dst, lse,
        scale, num_splits,
        q.stride(0), q.stride(1), *kv.k.stride()[:3], *kv.v.stride()[:3], *k_scale_strides, *v_scale_strides,
        block_tables.stride(0), *dst_strides, *lse_strides,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, QUANTIZED=kv.quantized, PRECISION=dot_precision(q, kv.k),
        SPLIT=num_splits > 1,
        num_warps=8 if head_dim > 64 else 4,  # sm_90 build, head_dim 128: <= 128 registers/thread vs up to 168
    )
    if num_splits > 1:
        _merge_kernel[(batch, num_heads)](
            partial, lse, out, num_splits, *partial.stride()[:3], *lse.stride()[:2], *out.stride()[:2],
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out
