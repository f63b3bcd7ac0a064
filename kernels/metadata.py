"""What one forward pass tells the attention kernels: where new tokens go and which blocks each sequence reads."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LayerKV:
    """One layer's views into the paged cache; strides are arbitrary because a block spans all layers.

    The views are indexed [block, token, head, ...] whatever the memory order (head-major, see KVLayout).

    k, v: [num_blocks, block_size, num_kv_heads, head_dim] (float, or int8 when quantized).
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads] float16 when int8, else None.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@dataclass(slots=True)
class AttentionMetadata:
    """A flat batch: the tokens of prefill chunks come first, then one token per decoding sequence.

    slot_mapping[t] = block_id * block_size + offset is where token t's K/V are written.
    Prefill sequence i owns queries cu_seqlens_q[i]:cu_seqlens_q[i+1] and attends (causally) to
    prefill_context_lens[i] cached tokens, the chunk itself included.
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_cu_seqlens_q: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    # Host copies: the torch path loops over prefill sequences and must not sync a device per item.
    prefill_cu_seqlens_q_host: list[int]
    prefill_context_lens_host: list[int]

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_context_lens_host)
