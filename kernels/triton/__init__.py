"""Triton kernels over the paged KV cache (CUDA; the interpreter runs them on CPU in tests)."""
