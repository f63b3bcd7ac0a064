"""The small operations around a decoder layer's matmuls and attention (RMSNorm, the residual seam, rotary
embedding, SwiGLU): torch ops, or on CPU one fused C++ call each (cpu/pointwise.cpp), which at batch 1 saves about as
much dispatch time as the weights take to read. backend.py picks which set a model runs with."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata.kernels.cpu.build import build_kernels


@dataclass(slots=True, frozen=True)
class LayerOps:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (RMSNorm of x + residual, x + residual)
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32 like the reference implementation, so fp32 outputs match it bit for bit."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return torch_rms_norm(residual, weight, eps), residual


def torch_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by cos / sin [T, 1, D] (rotate-half convention, as in HF Llama)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


TORCH_OPS = LayerOps("torch", torch_rms_norm, torch_add_rms_norm, torch_rope, torch_silu_mul)


def _fused(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and (weight is None or weight.dtype == torch.float32)


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _fused(x, weight):
        return torch_rms_norm(x, weight, eps)
    return build_kernels().rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def cpu_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual is updated in place (it is the layer stack's own running sum)."""
    if not _fused(x, weight) or residual.dtype != torch.float32:
        return torch_add_rms_norm(x, residual, weight, eps)
    shape = x.shape
    out = build_kernels().add_rms_norm(x.reshape(-1, shape[-1]), residual.view(-1, shape[-1]), weight, eps)
    return out.view(shape), residual


def cpu_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (views of the step's fresh qkv output)."""
    if not (_fused(q) and _fused(cos)):
        return torch_rope(q, k, cos, sin)
    kernels, cos, sin = build_kernels(), cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1)
    kernels.rope_(q, cos, sin)
    kernels.rope_(k, cos, sin)
    return q, k


def cpu_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not _fused(gate_up):
        return torch_silu_mul(gate_up)
    return build_kernels().silu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(*gate_up.shape[:-1], -1)


CPU_OPS = LayerOps("cpu", cpu_rms_norm, cpu_add_rms_norm, cpu_rope, cpu_silu_mul)
