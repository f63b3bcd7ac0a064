"""KV tensor storage: one contiguous byte region per block, holding K and V (and INT8 scales) of every layer.

A block spans all layers so that swapping it to host memory is one copy. Layer views are strided slices of
that region, which is why kernels take arbitrary strides.
"""

from dataclasses import dataclass

import torch

from strata.kernels import LayerKV

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
SCALE_DTYPE = torch.float16  # see kernels.torch_reference.quantize_int8


@dataclass(slots=True, frozen=True)
class KVLayout:
    """Shape of one block: [layers, K/V, kv_heads, block_size, head_dim] elements, then INT8 scales if any.

    Head-major inside a layer: one head's tokens of a block are one contiguous run, so gathering a sequence's keys
    per head is a plain row copy that lands in the [head, token, dim] layout attention matmuls read.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv dtype {self.kv_dtype!r}; choose one of auto, {', '.join(KV_DTYPES)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "int8"

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=KV_DTYPES[self.kv_dtype]).element_size()

    @property
    def values_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def scales_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads if self.quantized else 0

    @property
    def block_bytes(self) -> int:
        data = self.values_per_block * self.element_bytes
        scales = self.scales_per_block * SCALE_DTYPE.itemsize
        return -(-(data + scales) // 16) * 16  # 16-byte aligned so every view of every block is aligned

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size


class KVStorage:
    """A pool of `num_blocks` block regions on one device, with per-layer K/V (and scale) views."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device, pin_memory: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.buffer = torch.zeros(
            (num_blocks, layout.block_bytes), dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
        self.layers = [self._layer_view(layer) for layer in range(layout.num_layers)]

    def _layer_view(self, layer: int) -> LayerKV:
        lay = self.layout
        dtype = KV_DTYPES[lay.kv_dtype]
        elem = lay.element_bytes
        flat = self.buffer.view(-1).view(dtype)
        row = lay.block_bytes // elem
        kv_stride = lay.block_size * lay.num_kv_heads * lay.head_dim
        shape = (self.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
        stride = (row, lay.head_dim, lay.block_size * lay.head_dim, 1)  # head-major, see KVLayout
        k = flat.as_strided(shape, stride, storage_offset=layer * 2 * kv_stride)
        v = flat.as_strided(shape, stride, storage_offset=(layer * 2 + 1) * kv_stride)
        if not lay.quantized:
            return LayerKV(k, v)
        scales = self.buffer.view(-1).view(SCALE_DTYPE)
        scale_row = lay.block_bytes // SCALE_DTYPE.itemsize
        scale_base = lay.values_per_block * elem // SCALE_DTYPE.itemsize
        scale_kv = lay.block_size * lay.num_kv_heads
        scale_shape = (self.num_blocks, lay.block_size, lay.num_kv_heads)
        scale_stride = (scale_row, 1, lay.block_size)
        k_scale = scales.as_strided(scale_shape, scale_stride, storage_offset=scale_base + layer * 2 * scale_kv)
        v_scale = scales.as_strided(scale_shape, scale_stride, storage_offset=scale_base + (layer * 2 + 1) * scale_kv)
        return LayerKV(k, v, k_scale, v_scale)

    def copy_blocks_to(self, other: "KVStorage", pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src here -> dst there): one copy per block, e.g. for swap-out and swap-in."""
        for src, dst in pairs:
            other.buffer[dst].copy_(self.buffer[src], non_blocking=True)
