"""Triton paged-attention kernels against the torch reference computed in float64 on the same cache contents.

Runs on CPU under TRITON_INTERPRET=1 (set by conftest), or on CUDA when TRITON_INTERPRET=0 (benchmarks/gpu_check.sh).
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from helpers.triton_device import DEVICE, INTERPRET, needs_triton_device  # noqa: E402

from strata.cache.kv.storage import KVLayout, KVStorage  # noqa: E402
from strata.kernels import AttentionMetadata, get_backend, torch_reference  # noqa: E402
from strata.kernels.triton.attention_backend import BACKEND  # noqa: E402
from strata.kernels.triton.decode import paged_decode_attention  # noqa: E402

pytestmark = needs_triton_device

NUM_KV_HEADS = 2
NUM_BLOCKS = 48
# (query dtype, kv cache dtype) -> max relative error against float64
DTYPES = {
    "fp32": (torch.float32, "fp32", 1e-3),
    "bf16": (torch.bfloat16, "bf16", 2e-2),
    "fp16": (torch.float16, "fp16", 1e-2),
    "int8-fp32": (torch.float32, "int8", 2e-2),
    "int8-bf16": (torch.bfloat16, "int8", 2e-2),
}
# Every pair of (GQA group, head_dim, block_size, fp32/bf16/INT8 dtype) values appears in some case: 16 cases
# instead of the 96 of the full product; plus two fp16 cases.
CASES = [
    (1, 64, 8, "fp32"), (1, 128, 16, "bf16"), (1, 64, 32, "int8-bf16"), (1, 128, 8, "int8-fp32"),
    (3, 128, 8, "int8-fp32"), (3, 64, 16, "fp32"), (3, 128, 32, "bf16"), (3, 64, 32, "int8-bf16"),
    (4, 64, 8, "bf16"), (4, 128, 16, "int8-bf16"), (4, 64, 32, "int8-fp32"), (4, 128, 32, "fp32"),
    (8, 128, 8, "int8-bf16"), (8, 64, 16, "int8-fp32"), (8, 128, 32, "fp32"), (8, 64, 8, "bf16"),
    (4, 64, 16, "fp16"), (8, 128, 32, "fp16"),
]
CASE_IDS = [f"g{g}-d{d}-bs{bs}-{dt}" for g, d, bs, dt in CASES]


def _poisoned_empty(real):
    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return empty


@pytest.fixture
def poison(monkeypatch):
    """Every float buffer the kernels allocate (outputs, split-K partials) starts as NaN: unwritten rows show."""
    monkeypatch.setattr(torch, "empty", _poisoned_empty(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned_empty(torch.empty_like))


class Caches:
    """The same K/V written into a NaN-poisoned cache (read by the kernels) and a clean one (read by the reference).

    Both are layer 1 of a 2-layer KVStorage, so block strides span the whole multi-layer region.
    """

    def __init__(self, head_dim: int, block_size: int, kv_dtype: str, gen: torch.Generator):
        layout = KVLayout(2, NUM_KV_HEADS, head_dim, block_size, kv_dtype)
        self.poisoned = KVStorage(layout, NUM_BLOCKS, DEVICE)
        self.poisoned.buffer.fill_(0xFF)  # NaN for fp32/bf16 values and INT8 scales
        self.clean = KVStorage(layout, NUM_BLOCKS, DEVICE)
        self.block_size = block_size
        self.perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # blocks are handed out scattered

    def allocate(self, lengths: list[int]) -> torch.Tensor:
        """A block table (int32, padded with an unused block) for sequences of these lengths."""
        needed = [-(-n // self.block_size) for n in lengths]
        table = torch.full((len(lengths), max(needed)), self.perm[-1], dtype=torch.int32)
        for i, n in enumerate(needed):
            table[i, :n] = torch.tensor([self.perm.pop(0) for _ in range(n)])
        return table.to(DEVICE)

    def fill(self, table: torch.Tensor, lengths: list[int], dtype: torch.dtype, gen: torch.Generator) -> None:
        """Write random K/V for every position of every sequence, through the reference write_kv, into both caches."""
        _, _, num_heads, head_dim = self.clean.layers[1].k.shape
        for row, n in zip(table.cpu(), lengths, strict=True):
            pos = torch.arange(n)
            slots = (row.long()[pos // self.block_size] * self.block_size + pos % self.block_size).to(DEVICE)
            k, v = (torch.randn(n, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
            for storage in (self.poisoned, self.clean):
                torch_reference.write_kv(k, v, storage.layers[1], slots)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("kv_dtype,key_dtype", [("int8", torch.bfloat16), ("int8", torch.float32),
                                                ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_write_kv_matches_reference(kv_dtype, key_dtype):
    gen = torch.Generator().manual_seed(1)
    layout = KVLayout(2, 3, 64, 16, kv_dtype)
    ours, ref = KVStorage(layout, 8, DEVICE), KVStorage(layout, 8, DEVICE)
    qkv = torch.randn(13, 5 * 3 * 64, generator=gen).to(key_dtype).to(DEVICE) * 3  # K/V are strided views
    key, value = qkv[:, : 3 * 64].view(13, 3, 64), qkv[:, 3 * 64: 6 * 64].view(13, 3, 64)
    key[0] = 0.0  # an all-zero row: the scale clamps instead of dividing by zero
    key[1, 0] = 0.0
    key[1, 0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale 1: exact ties, which round to even
    slots = torch.randperm(8 * 16, generator=gen)[:13].to(DEVICE)
    torch_reference.write_kv(key, value, ref.layers[1], slots)
    BACKEND.write_kv(key, value, ours.layers[1], slots)
    assert torch.equal(ours.buffer, ref.buffer)  # bit-exact, INT8 rounding and scales included
    before = ours.buffer.clone()
    BACKEND.write_kv(key[:2] + 1, value[:2] + 1, ours.layers[1], torch.tensor([-1, -1], device=DEVICE))
    assert torch.equal(ours.buffer, before)  # negative slots are padding: skipped


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decode_matches_reference(case, poison):
    group, head_dim, block_size, dtypes = case
    q_dtype, kv_dtype, tol = DTYPES[dtypes]
    gen = torch.Generator().manual_seed(CASES.index(case))
    caches = Caches(head_dim, block_size, kv_dtype, gen)
    # Length 1, mid-block ends, one exactly on a block boundary, one spanning several split tiles.
    lengths = [1, block_size + 3, 2 * block_size, 75]
    table = caches.allocate(lengths)
    caches.fill(table, lengths, q_dtype, gen)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lengths), group * NUM_KV_HEADS, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    scale = head_dim**-0.5
    ref = torch_reference.paged_decode_attention(q.double(), caches.clean.layers[1], table, context_lens, scale)
    for num_splits in (1, 3):  # plain, and split-K with an empty split for the short sequences
        out = paged_decode_attention(q, caches.poisoned.layers[1], table, context_lens, scale, num_splits=num_splits)
        assert out.dtype == q_dtype and not out.isnan().any()
        assert rel_error(out, ref) < tol, f"num_splits={num_splits}"


def prefill_metadata(table: torch.Tensor, context_lens: list[int], q_lens: list[int]) -> AttentionMetadata:
    """Metadata of a prefill-only batch (slot_mapping unused by the attention itself)."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    device = table.device
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), num_prefill_tokens=cu[-1],
        prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        prefill_context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        prefill_block_tables=table, decode_context_lens=torch.empty(0, dtype=torch.int32, device=device),
        decode_block_tables=torch.empty(0, 1, dtype=torch.int32, device=device),
        prefill_cu_seqlens_q_host=cu, prefill_context_lens_host=list(context_lens),
    )


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_prefill_matches_reference(case, poison):
    group, head_dim, block_size, dtypes = case
    q_dtype, kv_dtype, tol = DTYPES[dtypes]
    gen = torch.Generator().manual_seed(100 + CASES.index(case))
    caches = Caches(head_dim, block_size, kv_dtype, gen)
    # (context incl. chunk, chunk): a 1-token prompt; a whole prompt; a chunk after a mid-block prefix; a chunk
    # after a block-aligned (prefix-cached) prefix, long enough for several row tiles at any group size.
    context_lens = [1, 21, block_size + 9, 2 * block_size + 70]
    q_lens = [1, 21, 12, 70]
    table = caches.allocate(context_lens)
    caches.fill(table, context_lens, q_dtype, gen)
    meta = prefill_metadata(table, context_lens, q_lens)
    q = torch.randn(sum(q_lens), group * NUM_KV_HEADS, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    scale = head_dim**-0.5
    ref = torch_reference.paged_prefill_attention(q.double(), caches.clean.layers[1], meta, scale)
    out = BACKEND.prefill(q, caches.poisoned.layers[1], meta, scale)
    assert out.dtype == q_dtype and not out.isnan().any()
    assert rel_error(out, ref) < tol


def test_dispatch_picks_triton():
    name = "triton-interpret" if INTERPRET else "triton"
    assert get_backend(name, DEVICE) is BACKEND
    assert get_backend("auto", torch.device("cpu")).name == "cpu"


# (query dtype, kv dtype, head_dim, group) built for sm_90; each runs write + decode (plain, split-K) + prefill.
SM90_BUILDS = [(torch.bfloat16, "bf16", 128, 4), (torch.bfloat16, "int8", 64, 8), (torch.float32, "fp32", 128, 1),
               (torch.float16, "int8", 128, 3)]


def test_cuda_build_compiles_without_spills():
    """The CUDA path never runs in CI, so compile what its launches would compile, for an H100/H200 (sm_90), with
    Triton's own LLVM and the ptxas in its wheel: no GPU needed. Catches what the interpreter lets through (dot
    shapes, broadcasting in builtins, types) and register spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = str(Path(__file__).parents[1])        # the script imports `helpers`, as pytest's pythonpath lets tests do
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count("0 bytes spill stores") == 5 * len(SM90_BUILDS), done.stdout


def compile_for_sm90() -> None:
    """Run the real wrappers on CPU tensors with JITFunction.run swapped for: bind and specialise the arguments as a
    CUDA launch would, compile for sm_90, print ptxas' register/spill report (no kernel runs)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

    def compile_instead(fn, *args, grid, warmup, **kwargs):
        bind = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = bind(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        kernel = compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        ptx = Path(tempfile.mkdtemp()) / f"{fn.__name__}.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True,
                                check=True).stderr
        usage = [line.split(":")[-1].strip() for line in report.splitlines() if "spill" in line or "registers" in line]
        print(fn.__name__, "; ".join(usage), flush=True)

    JITFunction.run = compile_instead
    cpu = torch.device("cpu")
    for q_dtype, kv_dtype, head_dim, group in SM90_BUILDS:
        kv = KVStorage(KVLayout(2, 2, head_dim, 16, kv_dtype), 8, cpu).layers[1]
        q = torch.zeros(4, 2 * group, head_dim, dtype=q_dtype)
        table = torch.zeros(4, 3, dtype=torch.int32)
        BACKEND.write_kv(q[:, :2], q[:, :2], kv, torch.zeros(4, dtype=torch.int64))
        for num_splits in (1, 2):
            paged_decode_attention(q, kv, table, torch.ones(4, dtype=torch.int32), 0.1, num_splits=num_splits)
        BACKEND.prefill(q, kv, prefill_metadata(table, [4, 4, 4, 4], [1, 1, 1, 1]), 0.1)


if __name__ == "__main__":
    compile_for_sm90()
