"""A pure-decode step of the whole decoder stack in one C++ call (decode_stack.cpp): the same kernels, in the same order,
as the layer-by-layer path, without the Python around each layer (about a third of a batch-1 step of SmolLM2-135M).

It applies where that path would run those very kernels: compact weights (f16, bf16, Q8_0, Q4) on CPU, fp32
activations, a float K/V cache, no prefill rows, at most KERNEL_MAX_ROWS rows (above that the linears go to BLAS).
"""

from dataclasses import dataclass

import torch

from strata.kernels.cpu import weight_linear
from strata.kernels.cpu.build import build_kernels
from strata.kernels.metadata import AttentionMetadata, LayerKV


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One decoder layer's weights as the stack needs them: the two norms' weights and four compact linears, each
    (format, weight, scales, mins, bias, in_features) as models/compact_linear.CompactLinear holds them."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    linears: tuple[tuple, tuple, tuple, tuple]       # qkv, o, gate_up, down


class DecodeStack:
    """Built once per model; `accepts` says whether a step can run through it, `__call__` runs it."""

    def __init__(self, layers: list[StackLayer], final_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, scale: float):
        kernels = build_kernels()
        self.scale = scale
        self._stack = kernels.DecodeStack(num_heads, num_kv_heads, head_dim, eps, final_norm.float().contiguous())
        empty = torch.empty(0)
        for layer in layers:
            compact = [kernels.CompactWeight(weight, empty if scales is None else scales,
                                             empty if mins is None else mins, bias, weight_linear.FORMATS[format],
                                             in_features)
                       for format, weight, scales, mins, bias, in_features in layer.linears]
            self._stack.add_layer(layer.input_norm.float().contiguous(), layer.post_norm.float().contiguous(),
                                  *compact)

    @staticmethod
    def accepts(x: torch.Tensor, kv_layers: list[LayerKV], meta: AttentionMetadata) -> bool:
        return (meta.num_prefill_tokens == 0 and 0 < x.shape[0] <= weight_linear.KERNEL_MAX_ROWS
                and x.dtype == torch.float32 and x.device.type == "cpu" and not kv_layers[0].quantized)

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_layers: list[LayerKV],
                 meta: AttentionMetadata) -> torch.Tensor:
        """x: the embeddings [B, hidden]; rope: cos / sin [B, 1, head_dim]. Returns the final norm's output."""
        cos, sin = (t.reshape(t.shape[0], -1) for t in rope)
        return self._stack.forward(x.contiguous(), cos, sin, [kv.k for kv in kv_layers], [kv.v for kv in kv_layers], meta.slot_mapping,
                                   meta.decode_block_tables.to(torch.int32).contiguous(),
                                   meta.decode_context_lens.to(torch.int32).contiguous(), self.scale)
