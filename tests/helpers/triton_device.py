"""Where the Triton kernel tests run: on CPU under TRITON_INTERPRET=1 (set by conftest), or on CUDA when
TRITON_INTERPRET=0 (benchmarks/gpu_check.sh); a module marked `needs_triton_device` skips elsewhere."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
needs_triton_device = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                         reason="Triton needs CUDA, or TRITON_INTERPRET=1 for the CPU interpreter")
