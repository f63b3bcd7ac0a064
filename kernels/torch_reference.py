"""Paged-attention reference in plain torch: the CPU backend and the oracle for the Triton kernels."""

import torch

from strata.kernels.metadata import AttentionMetadata, LayerKV

INT8_MAX = 127.0
MIN_ABSMAX = 1e-5  # keeps the fp16 scale of an all-zero row non-zero


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 with one fp16 scale per (token, kv-head): x [T, H, D] -> (int8 [T, H, D], scale [T, H]).

    The scale is rounded to fp16 before dividing, so what is stored dequantizes exactly as it was quantized;
    fp16 scales (not fp32) keep an INT8 block close to twice the tokens of a bf16 one.
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
    """K/V of the blocks in block_table ([..., n]) as contiguous [H, ..., n * block_size, D] in dtype.

    One head's tokens of one block are a contiguous run (head-major layout), so per head an index_select copies
    whole runs straight into the head-first layout that batched matmuls read: one pass, no transposing copy.
    """
    index = block_table.reshape(-1).long()
    lead, n = block_table.shape[:-1], block_table.shape[-1]
    num_blocks, block_size, num_heads, head_dim = kv.k.shape

    def rows(view: torch.Tensor) -> torch.Tensor:  # [H, blocks, block_size * (D or 1)] in the cache's dtype
        run = view[0, :, 0].numel()
        out = torch.empty((num_heads, index.numel(), run), dtype=view.dtype, device=view.device)
        for head in range(num_heads):  # .view, not .reshape: a copy of the whole pool here would be silent
            torch.index_select(view[:, :, head].view(num_blocks, -1), 0, index, out=out[head])
        return out

    def load(view: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = rows(view).view(num_heads, -1, block_size, head_dim)
        if scale is not None:  # int8 is exact in dtype, so this equals dequantizing first
            x = torch.mul(x, rows(scale).to(dtype).unsqueeze(-1))
        return x.to(dtype).view(num_heads, *lead, n * block_size, head_dim)

    return load(kv.k, kv.k_scale), load(kv.v, kv.v_scale)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Attention math runs in the query's dtype, except fp16, which CPUs only emulate (slowly)."""
    return torch.float32 if dtype == torch.float16 else dtype


# How many padded cached tokens one more length group is worth: chosen by sweeping 0, 256, ..., 4096 for a batch of
# 64 mixed lengths (benchmarks/decode_step.py; docs/benchmarks.md).
GROUP_OVERHEAD_TOKENS = 1024


def group_by_length(context_lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Split a decode batch into groups of similar length: (rows, blocks to read), longest first.

    Padding every sequence to the longest one wastes most of the work in a batch of mixed lengths; a new group
    starts where lowering the padded width for every remaining sequence saves more than a group costs.
    """
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__, reverse=True)
    groups: list[tuple[list[int], int]] = []
    for i, row in enumerate(order):
        blocks = -(-context_lens[row] // block_size)
        if groups and (groups[-1][1] - blocks) * block_size * (len(order) - i) <= GROUP_OVERHEAD_TOKENS:
            groups[-1][0].append(row)
        else:
            groups.append(([row], blocks))
    return groups


def paged_decode_attention(
    q: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D].

    Sequences are grouped by length so that short ones are not padded to the longest one.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv.k.shape[2], kv.k.shape[1]
    dtype = compute_dtype(q.dtype)
    qg = (q.to(dtype) * scale).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    lens = context_lens.tolist()
    groups = group_by_length(lens, block_size)
    if len(groups) == 1:
        out = attend_decode(qg, kv, block_tables[:, :groups[0][1]], context_lens, min(lens), dtype)
    else:
        # Sort once so that every group is a slice, not a gather, of the batch.
        order = torch.tensor([r for rows, _ in groups for r in rows], device=q.device)
        q_sorted, tables, sorted_lens = qg.index_select(1, order), block_tables[order], context_lens[order]
        out_sorted = torch.empty_like(q_sorted)
        start = 0
        for rows, blocks in groups:
            end = start + len(rows)
            out_sorted[:, start:end] = attend_decode(q_sorted[:, start:end], kv, tables[start:end, :blocks],
                                                     sorted_lens[start:end], min(lens[r] for r in rows), dtype)
            start = end
        out = torch.empty_like(qg).index_copy_(1, order, out_sorted)
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim).to(q.dtype)


def attend_decode(qg: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  shortest: int, dtype: torch.dtype) -> torch.Tensor:
    """Scaled queries [Hkv, b, G, D] against the blocks in block_tables -> [Hkv, b, G, D].

    GQA without copies: the G query heads of a KV head are G rows against that head's keys, so two batched
    matmuls cover every group; on CPU they beat SDPA's flash kernel for so few query rows.
    """
    k, v = gather_kv(kv, block_tables, dtype)  # [Hkv, b, L, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).to(torch.promote_types(dtype, torch.float32))  # softmax >= fp32
    if shortest < k.shape[2]:
        valid = torch.arange(k.shape[2], device=qg.device) < context_lens[:, None]
        scores.masked_fill_(~valid[None, :, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(dtype), v)


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
        k, v = gather_kv(kv, meta.prefill_block_tables[i, :used_blocks], dtype)  # [Hkv, L, D]
        k, v = k[:, :context_len], v[:, :context_len]
        # Query j sits at absolute position context_len - q_len + j and sees keys up to it; without a cached
        # prefix that is plain causal attention, which SDPA runs without materializing a mask.
        mask = None
        if q_len != context_len:
            q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        # 4-d inputs: SDPA runs 3-d ones (and GQA) through its slow math path on CPU, 4-d through flash.
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].to(dtype).transpose(0, 1)[None], k[None], v[None],
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_kv_heads != num_heads,
        )
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out
