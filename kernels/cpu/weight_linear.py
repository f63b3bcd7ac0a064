"""Linear layers over compact weights on CPU (weight_linear.cpp): fp16, bf16, or GGUF-style blocks of 32 (Q8_0,
Q4_0/Q4_1). bf16 weights multiply activations rounded to bf16 (AVX512_BF16 dot products where the CPU has them); Q8_0
and Q4 weights at decode batches multiply activations quantized to Q8_0 blocks (int8 dot products, as llama.cpp); fp16
weights multiply in fp32.

Float formats: small batches (decode) run the C++ kernel, which widens each weight row in cache; large ones (prefill)
widen the whole weight once and hand it to BLAS, which is faster when many activation rows share the weight. bf16
weights on a CPU with AMX tiles skip the widening: oneDNN multiplies them as they are on AMX, 3-4x faster than fp32
BLAS at 64-256 rows (benchmarks/results/cpu_profile/amx_prefill.json), its outputs rounded to bf16. Q8_0 and Q4
weights run the kernel's integer dot products at every batch size (tiled over weight and activation rows, faster
than widening + fp32 BLAS from 16 to 272 rows: cpu_profile/quantized_tiles_ab.json), so prefill and decode compute
a row alike and no fp32 copy of a weight is ever made.
"""

import torch

from strata.kernels.cpu.build import build_kernels

FORMATS = {"f16": 0, "q8": 1, "q4": 2, "bf16": 3}
# Above this many activation rows, widening the weight once and calling BLAS beats the row kernel (measured on the
# 2-core EPYC for SmolLM2-135M's shapes; see benchmarks/results/cpu_profile).
KERNEL_MAX_ROWS = 32
_EMPTY = torch.empty(0)     # the scales / mins argument of formats without them
AMX = torch.cpu._is_amx_tile_supported()       # bf16 prefill on AMX tiles (oneDNN) instead of widening to fp32


def load():
    """The compiled module, built once per machine; raises (RuntimeError, OSError, ...) when it cannot be built."""
    return build_kernels()


def linear(x: torch.Tensor, format: str, weight: torch.Tensor, scales: torch.Tensor | None,
           mins: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """x [..., K] (any float dtype) times the compact weight [N, K] transposed -> [..., N] in x's dtype, fp32 math."""
    kernels, code = load(), FORMATS[format]
    scales = _EMPTY if scales is None else scales
    mins = _EMPTY if mins is None else mins
    # decode sizes decide without asking the module (a call per layer per step); Q8_0 / Q4 take the kernel at any size
    on_kernel = x.numel() <= KERNEL_MAX_ROWS * in_features or quantizes_activations(format)
    if on_kernel and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return kernels.linear(x, weight, scales, mins, code, in_features)   # a decode step's case, nothing to adapt
    rows = x.reshape(-1, in_features).float().contiguous()
    if on_kernel:
        out = kernels.linear(rows, weight, scales, mins, code, in_features)
    elif format == "bf16" and AMX:
        out = torch.nn.functional.linear(rows.bfloat16(), weight).float()
    else:
        if format == "bf16":
            rows = rows.bfloat16().float()      # the rounding the kernel applies, so prefill and decode agree
        out = torch.nn.functional.linear(rows, kernels.dequantize(weight, scales, mins, code, in_features))
    return out.view(*x.shape[:-1], -1).to(x.dtype)


def native_bf16() -> bool:
    """Whether bf16 weights run on AVX512_BF16 dot products on this machine (else an fp32 fallback)."""
    return load().native_bf16()


def quantizes_activations(format: str) -> bool:
    """Whether the kernel multiplies this format's weights by activations quantized to Q8_0 blocks here, at every
    batch size: Q8_0 and Q4 wherever the build has AVX2 or AVX-512 VNNI integer dot products."""
    return format in ("q8", "q4") and load().quantized_dot()


def dequantize(format: str, weight: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None,
               in_features: int) -> torch.Tensor:
    """The compact weight as fp32 [N, K]."""
    return load().dequantize(weight, _EMPTY if scales is None else scales, _EMPTY if mins is None else mins,
                             FORMATS[format], in_features)
