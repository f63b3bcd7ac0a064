"""The one place that picks kernels: for attention Triton on CUDA, the C++ decode kernel on CPU (torch when it cannot be
built), the torch reference or the Triton interpreter on request; for weights the CPU's fastest format."""

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata.kernels import torch_reference
from strata.kernels.cpu import paged_decode as cpu_paged
from strata.kernels.cpu import weight_linear
from strata.kernels.layer_ops import CPU_OPS, TORCH_OPS, LayerOps
from strata.kernels.metadata import AttentionMetadata, LayerKV

BACKENDS = ("auto", "cpu", "torch", "triton", "triton-interpret")
log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class AttentionBackend:
    """The three attention operations the model calls per layer, bound to one implementation, and the small
    operations around them (norms, rotary embedding, SwiGLU)."""

    name: str
    write_kv: Callable[[torch.Tensor, torch.Tensor, LayerKV, torch.Tensor], None]
    decode: Callable[[torch.Tensor, LayerKV, torch.Tensor, torch.Tensor, float], torch.Tensor]
    prefill: Callable[[torch.Tensor, LayerKV, AttentionMetadata, float], torch.Tensor]
    ops: LayerOps = TORCH_OPS
    decode_stack: bool = False      # pure-decode steps may run the whole decoder in one C++ call (cpu/decode_stack.py)


TORCH = AttentionBackend(
    "torch", torch_reference.write_kv, torch_reference.paged_decode_attention, torch_reference.paged_prefill_attention
)
# Decode reads the cache in place and float K/V are written by one call (cpu/paged_decode.cpp); INT8 writes and prefill
# (compute-bound, SDPA's flash kernel) stay on torch; the small per-layer ops are fused C++ (cpu/pointwise.cpp).
CPU = AttentionBackend("cpu", cpu_paged.write_kv, cpu_paged.paged_decode_attention,
                       torch_reference.paged_prefill_attention, CPU_OPS, decode_stack=True)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' means Triton on CUDA and the C++ kernel elsewhere (torch if it cannot be built); Triton on CPU only runs
    under its interpreter."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "cpu" if cpu_kernel_builds() else "torch"
    if name == "cpu" and device.type != "cpu":
        raise ValueError("the 'cpu' backend runs on CPU tensors only")
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
    if resolved == "cpu":
        cpu_paged.load()          # a forced 'cpu' that cannot be built fails here, with the compiler's message
        return CPU
    from strata.kernels.triton import attention_backend  # imported lazily: triton is optional off CUDA

    return attention_backend.BACKEND


@functools.cache
def cpu_kernel_builds() -> bool:
    """Whether the C++ decode kernel is (or can be) built on this machine; says why once when it cannot."""
    try:
        cpu_paged.load()
    except Exception as exc:        # no compiler, no headers, a failed build: the torch reference still works
        log.warning("C++ CPU attention kernel unavailable (%s: %s); using the torch reference",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


@dataclass(slots=True, frozen=True)
class WeightChoice:
    """What --dtype auto runs on a CPU: activations' dtype, how linear weights are stored, and why (for the log)."""

    dtype: torch.dtype
    weight_format: str        # none (dense in dtype) or f16 (fp16 in memory, fp32 math: kernels/cpu/weight_linear)
    reason: str


def fastest_cpu_weights() -> WeightChoice:
    """Native bf16 (avx512_bf16): bf16 weights in the C++ kernel, whose AVX512_BF16 dot products beat oneDNN's dense
    bf16 at decode batches (SmolLM2 step, 2 threads, AVX-512 EPYC: 15.5 / 21 / 41 ms at 1 / 4 / 16 sequences
    against 28 / 28 / 41), activations fp32; oneDNN's dense bf16 when the kernel cannot use them. Otherwise (AVX-512
    or AVX2 only) fp32 math over fp16 weights, which halves the bytes a decode step reads (F16C widens them in
    registers); dense fp32 when the C++ kernel cannot be built."""
    isa = torch.backends.cpu.get_cpu_capability()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        if weight_kernel_builds() and weight_linear.native_bf16():
            prefill = "; prefill on AMX tiles (oneDNN)" if weight_linear.AMX else ""
            return WeightChoice(torch.float32, "bf16", f"{isa} with native bf16: bf16 weights and dot products, "
                                                       f"fp32 activations (C++ kernel){prefill}")
        return WeightChoice(torch.bfloat16, "none", f"{isa} with native bf16: bf16 weights and math (oneDNN)")
    if weight_kernel_builds():
        return WeightChoice(torch.float32, "f16", f"{isa} without native bf16: fp16 weights, fp32 math (C++ kernel)")
    return WeightChoice(torch.float32, "none", f"{isa} without native bf16 and no C++ weight kernel: fp32 weights")


def compact_weight_linear(device: torch.device) -> Callable[..., torch.Tensor]:
    """The kernel of compact (f16 / bf16 / Q8_0 / Q4) linear layers on `device`: C++ on CPU, Triton on CUDA
    (Q8_0 and Q4 only: dense fp16 / bf16 weights there are plain --dtype fp16 / bf16)."""
    if device.type == "cuda":
        from strata.kernels.triton import weight_linear as triton_weight_linear  # triton is optional off CUDA

        return triton_weight_linear.linear
    return weight_linear.linear


@functools.cache
def weight_kernel_builds() -> bool:
    """Whether the C++ compact-weight kernel is (or can be) built here; says why once when it cannot."""
    try:
        weight_linear.load()
    except Exception as exc:        # no compiler, no headers, a failed build
        log.warning("C++ CPU weight kernel unavailable (%s: %s); dense weights only",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True
