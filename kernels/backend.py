"""The one place that picks the attention implementation: Triton on CUDA, torch on CPU, interpreter on request."""

import os
from dataclasses import dataclass
from typing import Callable

import torch

from strata.kernels import torch_reference
from strata.kernels.metadata import AttentionMetadata, LayerKV

BACKENDS = ("auto", "torch", "triton", "triton-interpret")


@dataclass(slots=True, frozen=True)
class AttentionBackend:
    """The three operations the model calls per layer, bound to one implementation."""

    name: str
    write_kv: Callable[[torch.Tensor, torch.Tensor, LayerKV, torch.Tensor], None]
    decode: Callable[[torch.Tensor, LayerKV, torch.Tensor, torch.Tensor, float], torch.Tensor]
    prefill: Callable[[torch.Tensor, LayerKV, AttentionMetadata, float], torch.Tensor]


TORCH = AttentionBackend(
    "torch", torch_reference.write_kv, torch_reference.paged_decode_attention, torch_reference.paged_prefill_attention
)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' means Triton on CUDA and torch elsewhere; Triton on CPU only runs under its interpreter."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda":
        raise ValueError("the 'triton' backend needs a CUDA device; use 'triton-interpret' to run it on CPU")
    if name == "triton-interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("'triton-interpret' needs TRITON_INTERPRET=1 set before triton is first imported")
    return name


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Return the attention backend for `name` on `device` (see resolve_backend_name)."""
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":
        return TORCH
    from strata.kernels import triton_attention  # imported lazily: triton is optional off CUDA

    return triton_attention.BACKEND
