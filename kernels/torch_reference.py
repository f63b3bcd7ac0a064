"""Paged-attention reference in plain torch: the CPU backend and the oracle for the Triton kernels."""

import torch

from strata.kernels.metadata import AttentionMetadata, LayerKV

INT8_MAX = 127.0
MIN_ABSMAX = 1e-5  # keeps the fp16 scale of an all-zero row non-zero


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 with one fp16 scale per (token, kv-head): x [T, H, D] -> (int8 [T, H, D], scale [T, H]).

    The scale is rounded to fp16 before dividing, so what is stored dequantizes exactly as it was quantized;
    fp16 scales (not fp32) keep an INT8 block at 1.94x the tokens of bf16 for head_dim 64.
    """
    x = x.float()
    scale = (x.abs().amax(dim=-1).clamp_min(MIN_ABSMAX) / INT8_MAX).half().float()
    q = torch.round(x / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def write_kv(key: torch.Tensor, value: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, H, D]) into their slots, quantizing when the cache is INT8."""
    num_blocks, block_size = kv.k.shape[:2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    if kv.quantized:
        kq, ks = quantize_int8(key)
        vq, vs = quantize_int8(value)
        kv.k[blocks, offsets] = kq
        kv.v[blocks, offsets] = vq
        kv.k_scale[blocks, offsets] = ks.to(kv.k_scale.dtype)
        kv.v_scale[blocks, offsets] = vs.to(kv.v_scale.dtype)
    else:
        kv.k[blocks, offsets] = key.to(kv.k.dtype)
        kv.v[blocks, offsets] = value.to(kv.v.dtype)


def gather_kv(kv: LayerKV, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the blocks in block_table ([..., n]) as [..., n * block_size, H, D], dequantized to dtype.

    Each block of one layer is a contiguous row, so index_select copies whole rows (about 3x faster on CPU than
    advanced indexing over the 4-d view).
    """
    index = block_table.reshape(-1).long()

    def rows(view: torch.Tensor) -> torch.Tensor:
        return view.flatten(1).index_select(0, index).view(*index.shape, *view.shape[1:])

    k, v = rows(kv.k), rows(kv.v)
    if kv.quantized:
        k = k.to(dtype) * rows(kv.k_scale).unsqueeze(-1).to(dtype)
        v = v.to(dtype) * rows(kv.v_scale).unsqueeze(-1).to(dtype)
    else:
        k, v = k.to(dtype), v.to(dtype)
    shape = (*block_table.shape[:-1], -1, *kv.k.shape[2:])
    return k.reshape(shape), v.reshape(shape)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Attention math runs in the query's dtype, except fp16, which CPUs only emulate (slowly)."""
    return torch.float32 if dtype == torch.float16 else dtype


def paged_decode_attention(
    q: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D].

    GQA without copies: the G query heads of a KV head are G "query rows" against that head's keys, so one fused
    SDPA call per batch covers every group.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[2]
    block_size = kv.k.shape[1]
    used_blocks = (int(context_lens.max()) + block_size - 1) // block_size
    dtype = compute_dtype(q.dtype)
    k, v = gather_kv(kv, block_tables[:, :used_blocks], dtype)  # [B, L, Hkv, D]
    qg = q.to(dtype).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :], scale=scale
    )
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Chunks of new tokens ([T, Hq, D]) against their cached prefix plus themselves, causally."""
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    num_kv_heads = kv.k.shape[2]
    block_size = kv.k.shape[1]
    cu = meta.prefill_cu_seqlens_q_host
    dtype = compute_dtype(q.dtype)
    for i, context_len in enumerate(meta.prefill_context_lens_host):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        used_blocks = (context_len + block_size - 1) // block_size
        k, v = gather_kv(kv, meta.prefill_block_tables[i, :used_blocks], dtype)
        k, v = k[:context_len], v[:context_len]
        # Query j sits at absolute position context_len - q_len + j and sees keys up to it; without a cached
        # prefix that is plain causal attention, which SDPA runs without materializing a mask.
        mask = None
        if q_len != context_len:
            q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].to(dtype).transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_kv_heads != num_heads,
        )
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out
