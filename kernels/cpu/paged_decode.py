"""The CPU decode-attention kernel (paged_decode.cpp), built once per machine with the C++ compiler torch uses.

The build (tens of seconds, then cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions) needs g++ and ninja;
without them `load()` raises and the backend falls back to the torch reference.
"""

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

from strata.kernels.metadata import LayerKV

SOURCE = Path(__file__).with_name("paged_decode.cpp")
log = logging.getLogger(__name__)


def load():
    """The compiled module; raises (RuntimeError, OSError, ...) when it cannot be built here."""
    module, error = _build()
    if error is not None:
        raise error
    return module


STALE_LOCK_S = 600          # a build takes well under a minute or two; a lock this old was left by a killed one


@functools.cache
def _build():
    """Built (or found built) once per process; a failure is remembered too, not retried on every engine start."""
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    os.environ.setdefault("MAX_JOBS", "2")
    # per CPU and per checkout: torch rebuilds when the source path changes, so two installs sharing one name would
    # rebuild each other's module on every start
    name = f"strata_cpu_paged_decode_{cpu_fingerprint()}_{hashlib.sha256(str(SOURCE).encode()).hexdigest()[:6]}"
    try:
        clear_stale_lock(Path(_get_build_directory(name, verbose=False)))
        return build(name, [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                     extra_ldflags=["-fopenmp"], verbose=False), None
    except Exception as exc:
        return None, exc


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock a killed compile left behind (torch would wait on it for ever, so every later engine
    start hung); a fresh lock belongs to a build in progress and stays. True when one was removed."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime < max_age_s:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    log.warning("removed a stale kernel build lock %s (left by a build that was killed)", lock)
    return True


def cpu_fingerprint() -> str:
    """A short hash of this CPU's model and instruction-set flags: the build uses -march=native, so a cache directory
    shared by different CPUs (a mounted home, a container image) must not hand one CPU's build to another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.machine(), platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


def paged_decode_attention(q: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D], fp32 math whatever the cache holds."""
    empty = q.new_empty(0, dtype=torch.float16)
    out = load().paged_decode((q.float() * scale).contiguous(), kv.k, kv.v,
                              kv.k_scale if kv.quantized else empty, kv.v_scale if kv.quantized else empty,
                              block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous())
    return out.to(q.dtype)
