"""Builds the C++ kernels of this folder once per machine with the compiler torch uses (a minute on 2 cores, cached under
TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions). Needs g++ and ninja; without them the build raises."""

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)
# e.g. STRATA_CPU_MARCH=haswell: a server (or a benchmark) on this CPU runs the code paths an AVX2-only CPU runs
MARCH_VARIABLE = "STRATA_CPU_MARCH"


# bindings.cpp, the one source that includes torch/extension.h, first: it is the longest compile
SOURCES = ("bindings.cpp", "paged_decode.cpp", "weight_linear.cpp", "pointwise.cpp", "decode_stack.cpp")


def build_kernels():
    """This folder's kernels as one module, strata_cpu_kernels_*, compiled (or found compiled) once per process;
    raises when they cannot be built here (a failure is remembered too, not retried on every engine start)."""
    module, error = _build_once()
    if error is not None:
        raise error
    return module


@functools.cache
def _build_once():
    try:
        return _compile(), None
    except Exception as exc:
        return None, exc


def _compile():
    march = os.environ.get(MARCH_VARIABLE)
    if march:
        log.warning("%s=%s: C++ kernels built for -march=%s, not for this CPU", MARCH_VARIABLE, march, march)
        return build_for_march(march)
    folder = Path(__file__).parent
    # per CPU and per checkout: torch rebuilds when the source paths change, so two installs sharing one name would
    # rebuild each other's module on every start
    return _build(f"strata_cpu_kernels_{cpu_fingerprint()}_{hashlib.sha256(str(folder).encode()).hexdigest()[:6]}",
                  "native")


def build_for_march(march: str):
    """The same kernels compiled for another -march (e.g. haswell: AVX2, FMA, F16C, no AVX-512 or VNNI), as a separate
    module: lets a test or a benchmark on this CPU run the code paths a CPU with fewer extensions runs. Raises like
    build_kernels when it cannot be built."""
    return _build(f"strata_cpu_kernels_{march.replace('-', '_')}_{cpu_fingerprint()}", march)


def _build(name: str, march: str):
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    os.environ.setdefault("MAX_JOBS", "2")
    folder = Path(__file__).parent
    with building(Path(_get_build_directory(name, verbose=False))):
        return build(name, [str(folder / source) for source in SOURCES],
                     extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fopenmp", "-falign-loops=64"], extra_ldflags=["-fopenmp"],
                     verbose=False)


@contextlib.contextmanager
def building(build_dir: Path):
    """Hold the build folder for one builder at a time, by an flock the kernel releases when its holder dies. torch's
    own lock file stays behind when a compile is killed, and torch then waits on it for ever (a server stopped while
    it compiled made the next start hang); whoever holds the flock knows such a file is a dead build's, and removes it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "strata.lock", "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build of %s", build_dir.name)
            fcntl.flock(held, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            (build_dir / "lock").unlink()
            log.warning("removed the kernel build lock %s left by a build that was killed", build_dir / "lock")
        yield


def cpu_fingerprint() -> str:
    """A short hash of this CPU's model and instruction-set flags: the build uses -march=native, so a cache directory
    shared by different CPUs (a mounted home, a container image) must not hand one CPU's build to another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.machine(), platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]
