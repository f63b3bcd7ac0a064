"""Attention kernels over the paged KV cache: a torch reference (CPU) and Triton (CUDA), picked in `backend`."""

from strata.kernels.backend import AttentionBackend, WeightChoice, fastest_cpu_weights, get_backend
from strata.kernels.metadata import AttentionMetadata, LayerKV

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKV", "WeightChoice", "fastest_cpu_weights", "get_backend"]
