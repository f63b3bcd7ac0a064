#!/usr/bin/env bash
# GPU check (< 9 min on an H200): the Triton kernel and CUDA-graph tests on CUDA, the W8A16 / W4A16 weight kernel
# vs cuBLAS bf16 per layer shape, then decode tok/s of our engine (CUDA graphs, and eager as with --enforce-eager) vs
# HF transformers on dummy Llama-3.2-1B / Llama-3.1-8B shapes, as a fraction of the memory-bandwidth floor.
# Writes $OUT/gpu_kernel_tests.xml, $OUT/gpu_weight_linear.json and $OUT/gpu_check.json (OUT defaults to
# benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT"
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false  # compiled Triton, never the interpreter
# Without an install of the package (a bare machine), import `strata` from this checkout through a link.
if ! "$PYTHON" -c "import strata" 2>/dev/null; then
    shim="$(mktemp -d)"
    ln -s "$(pwd)" "$shim/strata"
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PYTHON" - <<'PY' || exit 2
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device visible to torch {torch.__version__} (built for CUDA {torch.version.cuda}); "
             "run this on an NVIDIA GPU with a CUDA build of torch (see Dockerfile.gpu)")
import triton
print(f"gpu_check: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
PY

# The sm_90 compile-only test is left out: here the kernels really run. Compiling each kernel variant takes about a
# second and the first H200 run's 150 s got through 71 cases on one process: pytest-xdist spreads them where present.
parallel=()
if "$PYTHON" -c "import xdist" 2>/dev/null; then parallel=(-n 8); fi
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider "${parallel[@]}" tests/kernels/test_triton_kernels.py \
    tests/kernels/test_triton_weight_linear.py tests/server/engine/test_cuda_graphs.py \
    -k "not compiles_without_spills" --junitxml "$OUT/gpu_kernel_tests.xml"
tests_rc=$?
timeout 120 "$PYTHON" benchmarks/gpu_weight_linear.py --out "$OUT" --budget-s 80
linear_rc=$?
timeout 270 "$PYTHON" benchmarks/gpu_check.py --out "$OUT" --budget-s 200
bench_rc=$?
echo "gpu_check: kernel tests rc=$tests_rc, weight-linear rc=$linear_rc, engine benchmark rc=$bench_rc" \
     "(124 = hit its time limit); results in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$linear_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
