"""The Triton attention backend (CUDA, or CPU under TRITON_INTERPRET=1) that kernels.backend dispatches to."""

from strata.kernels.backend import AttentionBackend
from strata.kernels.triton.decode import paged_decode_attention
from strata.kernels.triton.kv_write import write_kv
from strata.kernels.triton.prefill import paged_prefill_attention

BACKEND = AttentionBackend("triton", write_kv, paged_decode_attention, paged_prefill_attention)
