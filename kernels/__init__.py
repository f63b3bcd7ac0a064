"""Attention kernels over the paged KV cache: a torch reference (CPU) and Triton (CUDA), picked in `backend`."""

from strata.kernels.backend import AttentionBackend, get_backend
from strata.kernels.metadata import AttentionMetadata, LayerKV

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKV", "get_backend"]
