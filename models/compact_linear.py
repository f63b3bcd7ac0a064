"""Linear layers whose weights stay compact in memory: fp16, bf16, or GGUF's Q8_0 / Q4_0 / Q4_1 blocks of 32 values.

A decode step reads every weight once per token, so bytes per weight set its speed on CPU: fp32 4, fp16 and bf16 2,
Q8_0 1.06, Q4_x 0.56-0.63. Blocks are kept as GGUF lays them out (read from a .gguf as they are, or made by gguf-py's
quantizer, which rounds as llama.cpp does) and widened inside the kernel: kernels/cpu/weight_linear.cpp on CPU,
kernels/triton/weight_linear.py (Q8_0 and Q4 blocks) on CUDA.
"""

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from strata.kernels.backend import compact_weight_linear
from strata.kernels.cpu import weight_linear

GROUP = 32
# GGUF block type -> (kernel format, bytes per block); a Q4_0 block has no minimum: it is -8 * scale.
BLOCK_TYPES = {GGMLQuantizationType.Q8_0: ("q8", 34), GGMLQuantizationType.Q4_0: ("q4", 18),
               GGMLQuantizationType.Q4_1: ("q4", 20)}
# --quantization for float checkpoints: int8 = Q8_0 (symmetric), int4 = Q4_1 (scale and minimum per group).
FLOAT_QUANTIZATION = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_1}


class CompactLinear(nn.Module):
    """Drop-in for an nn.Linear (weight [out, in]) that is only read; `format` is f16, bf16, q8 or q4."""

    def __init__(self, format: str, weight: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None,
                 in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.format, self.in_features = format, in_features
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = compact_weight_linear(x.device)(x, self.format, self.weight, self.scales, self.mins, self.in_features)
        return out if self.bias is None else out + self.bias

    def unpacked_weight(self) -> torch.Tensor:
        """The [out, in] weight widened to fp32 (a copy, on the layer's device; widened by the CPU kernel)."""
        cpu = [None if t is None else t.cpu() for t in (self.weight, self.scales, self.mins)]
        return weight_linear.dequantize(self.format, *cpu, self.in_features).to(self.weight.device)

    @classmethod
    def from_blocks(cls, blocks: np.ndarray, block_type: GGMLQuantizationType, in_features: int,
                    bias: torch.Tensor | None = None) -> "CompactLinear":
        """From GGUF blocks: uint8 [out, in / 32 * block bytes] of a Q8_0, Q4_0 or Q4_1 tensor."""
        if block_type not in BLOCK_TYPES:
            supported = ", ".join(t.name for t in BLOCK_TYPES)
            raise ValueError(f"GGUF tensor type {block_type.name} cannot stay compact (supported: {supported})")
        format, size = BLOCK_TYPES[block_type]
        if in_features % GROUP or blocks.shape[-1] != in_features // GROUP * size:
            raise ValueError(f"{block_type.name} blocks of shape {blocks.shape} do not hold {in_features} columns")
        b = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8)).view(blocks.shape[0], -1, size)
        scales = b[..., :2].contiguous().view(torch.float16).float().flatten(1).contiguous()
        if block_type == GGMLQuantizationType.Q8_0:
            return cls(format, b[..., 2:].contiguous().view(torch.int8).flatten(1), scales, None, in_features, bias)
        if block_type == GGMLQuantizationType.Q4_1:
            mins = b[..., 2:4].contiguous().view(torch.float16).float().flatten(1).contiguous()
            codes = b[..., 4:]
        else:
            mins, codes = scales * -8.0, b[..., 2:]
        return cls(format, codes.contiguous().flatten(1), scales, mins, in_features, bias)

    @classmethod
    def from_linear(cls, linear: nn.Module, weight_format: str) -> "CompactLinear":
        """From a float layer: f16 or bf16 (weights rounded to it), int8 (Q8_0) or int4 (Q4_1)."""
        weight = linear.unpacked_weight() if hasattr(linear, "unpacked_weight") else linear.weight.detach()
        if weight_format in ("f16", "bf16"):
            dtype = torch.float16 if weight_format == "f16" else torch.bfloat16
            return cls(weight_format, weight.to(dtype).contiguous(), None, None, weight.shape[1], linear.bias)
        block_type = FLOAT_QUANTIZATION[weight_format]
        if weight.shape[1] % GROUP:
            raise ValueError(f"{weight_format} needs in_features divisible by {GROUP}, got {weight.shape[1]}")
        blocks = quants.quantize(weight.float().cpu().numpy(), block_type)
        return cls.from_blocks(blocks, block_type, weight.shape[1], linear.bias)
