"""The CPU attention paths against dense attention per sequence: the torch reference (also the Triton oracle) and the
C++ decode kernel that reads the paged cache in place (the CPU default).

The dense oracle sees only each sequence's own K/V in order, so the block gather, the head-major layout and the
grouping of a decode batch by length are all checked by it.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from strata.cache.kv.storage import KVLayout, KVStorage
from strata.kernels import get_backend, torch_reference
from strata.kernels.cpu import paged_decode as cpu_paged
from strata.kernels.torch_reference import group_by_length, quantize_int8


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, D] against k, v [L, Hkv, D] in float64, query head h reading KV head h // G."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v)


def written_values(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """What the cache returns for x: its dtype cast, or its INT8 dequantization."""
    if kv_dtype == "int8":
        q, s = quantize_int8(x)
        return q.double() * s.double().unsqueeze(-1)
    return x.to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[kv_dtype])).double()


def check_decode(lengths: list[int], kv_dtype: str, group: int, block_size: int = 8, head_dim: int = 32,
                 decode=torch_reference.paged_decode_attention, tol: float = 1e-9):
    """decode's output for a batch written through the cache; the torch reference computes in q's float64, the C++
    kernel in fp32 (hence its tolerance)."""
    gen = torch.Generator().manual_seed(len(lengths) * 31 + group)
    num_kv_heads = 2
    needed = [-(-n // block_size) for n in lengths]
    storage = KVStorage(KVLayout(3, num_kv_heads, head_dim, block_size, kv_dtype), sum(needed) + 1, torch.device("cpu"))
    storage.buffer.fill_(0x41)  # finite garbage in unused slots: padding must be masked, not read as zeros
    blocks = torch.randperm(sum(needed) + 1, generator=gen)
    table = torch.full((len(lengths), max(needed)), int(blocks[-1]), dtype=torch.int32)
    kv = storage.layers[1]
    keys, values = [], []
    for i, (n, b) in enumerate(zip(lengths, needed, strict=True)):
        table[i, :b] = blocks[sum(needed[:i]):sum(needed[:i]) + b]
        pos = torch.arange(n)
        slots = table[i].long()[pos // block_size] * block_size + pos % block_size
        k, v = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
        torch_reference.write_kv(k, v, kv, slots)
        keys.append(written_values(k, kv_dtype))
        values.append(written_values(v, kv_dtype))
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    out = decode(q, kv, table, torch.tensor(lengths, dtype=torch.int32), 0.3)
    assert out.dtype == q.dtype and out.shape == q.shape
    for i in range(len(lengths)):
        torch.testing.assert_close(out[i], dense_attention(q[i], keys[i], values[i], 0.3), rtol=tol, atol=tol)


def test_decode_matches_dense_attention_across_length_groups():
    lengths = [1, 3, 8, 9, 17, 250, 251, 700, 5, 640, 16, 2]
    assert len(group_by_length(lengths, 8)) > 2  # the batch really is split
    for kv_dtype in ("fp32", "bf16", "int8"):
        for group in (1, 3, 4):
            check_decode(lengths, kv_dtype, group)


def test_decode_single_group_and_single_sequence():
    check_decode([5, 7, 8], "fp32", 2)
    check_decode([1], "int8", 3)
    assert len(group_by_length([5, 7, 8], 8)) == 1


@pytest.mark.parametrize("head_dim", [32, 64, 128])     # the kernel's generic width and its two fixed ones
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
def test_cpu_kernel_matches_dense_attention(kv_dtype: str, head_dim: int):
    lengths = [1, 3, 8, 9, 17, 250, 251, 700, 5, 640, 16, 2]
    for group in (1, 3, 4):
        check_decode(lengths, kv_dtype, group, head_dim=head_dim, decode=cpu_paged.paged_decode_attention, tol=2e-5)
    check_decode([1], kv_dtype, 3, block_size=16, head_dim=head_dim, decode=cpu_paged.paged_decode_attention,
                 tol=2e-5)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "int8"])
def test_cpu_kv_write_stores_what_the_torch_reference_stores(kv_dtype: str):
    """The C++ write (float caches; INT8 goes through torch) puts every token's K/V, any strides in, in the same slots
    with the same values as the reference, and leaves every other slot alone."""
    gen = torch.Generator().manual_seed(5)
    layout = KVLayout(2, 3, 16, 8, kv_dtype)
    pools = [KVStorage(layout, 6, torch.device("cpu")) for _ in range(2)]
    for pool in pools:
        pool.buffer.fill_(0x41)
    slots = torch.randperm(6 * 8, generator=gen)[:11]
    qkv = torch.randn(11, 5 * 3 * 16, generator=gen)      # K and V as strided views of a fused projection
    k, v = qkv[:, :48].view(11, 3, 16), qkv[:, 96:144].view(11, 3, 16)
    torch_reference.write_kv(k, v, pools[0].layers[1], slots)
    cpu_paged.write_kv(k, v, pools[1].layers[1], slots)
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    with pytest.raises((RuntimeError, IndexError), match="outside the cache|out of bounds"):
        cpu_paged.write_kv(k[:1], v[:1], pools[1].layers[1], torch.tensor([6 * 8]))


def test_cpu_kernel_refuses_what_it_cannot_read():
    q = torch.randn(2, 3, 32)
    storage = KVStorage(KVLayout(1, 3, 32, 8, "fp32"), 4, torch.device("cpu"))
    kv = storage.layers[0]
    with pytest.raises(RuntimeError, match="heads"):
        cpu_paged.load().paged_decode(torch.randn(2, 4, 32), kv.k, kv.v, torch.empty(0), torch.empty(0),
                                      torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        cpu_paged.load().paged_decode(q, kv.k, kv.v, torch.empty(0), torch.empty(0),
                                      torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int32))
    paged_decode = cpu_paged.load().paged_decode
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_decode(q, kv.k, kv.v, torch.empty(0), torch.empty(0), torch.tensor([[0], [4]], dtype=torch.int32),
                     torch.ones(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="more than its block table holds"):
        paged_decode(q, kv.k, kv.v, torch.empty(0), torch.empty(0), torch.zeros(2, 1, dtype=torch.int32),
                     torch.tensor([1, 9], dtype=torch.int32))
    empty = paged_decode(q, kv.k, kv.v, torch.empty(0), torch.empty(0), torch.zeros(2, 1, dtype=torch.int32),
                         torch.tensor([0, 1], dtype=torch.int32))
    assert torch.isfinite(empty).all() and not empty[0].any()
    with pytest.raises(ValueError, match="CPU tensors only"):
        get_backend("cpu", torch.device("meta"))
    assert get_backend("auto", torch.device("cpu")).name == "cpu"     # the default on a machine with a compiler


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=80), st.sampled_from([8, 16, 32]))
def test_length_groups_cover_every_row_once_and_fit_it(lengths: list[int], block_size: int):
    groups = group_by_length(lengths, block_size)
    rows = [r for members, _ in groups for r in members]
    assert sorted(rows) == list(range(len(lengths)))
    widths = [blocks for _, blocks in groups]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)
    for members, blocks in groups:
        assert blocks == max(-(-lengths[r] // block_size) for r in members)


def test_without_a_compiler_auto_falls_back_to_torch_and_a_forced_cpu_says_why(monkeypatch, caplog):
    from strata.kernels import backend
    from strata.kernels.cpu import build

    monkeypatch.setattr(build, "_build_once", lambda: (None, RuntimeError("error: g++: command not found")))
    backend.cpu_kernel_builds.cache_clear()
    try:
        assert backend.resolve_backend_name("auto", torch.device("cpu")) == "torch"
        assert "using the torch reference" in caplog.text and "g++" in caplog.text
        with pytest.raises(RuntimeError, match="g\\+\\+"):
            get_backend("cpu", torch.device("cpu"))
    finally:
        backend.cpu_kernel_builds.cache_clear()


@pytest.mark.parametrize("onednn_bf16, kernel_bf16, builds, expected", [
    (True, True, True, (torch.float32, "bf16")),       # AVX512_BF16 dot products in the C++ kernel
    (True, False, True, (torch.bfloat16, "none")),     # a compiler without them: oneDNN's dense bf16
    (False, False, True, (torch.float32, "f16")),      # AVX2 / AVX-512 without bf16: fp16 weights, fp32 math
    (False, False, False, (torch.float32, "none")),    # no compiler: dense fp32
])
def test_dtype_auto_picks_the_weights_the_cpu_runs_fastest(monkeypatch, onednn_bf16, kernel_bf16, builds, expected):
    from strata.kernels import backend

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    monkeypatch.setattr(backend, "weight_kernel_builds", lambda: builds)
    monkeypatch.setattr(backend.weight_linear, "native_bf16", lambda: kernel_bf16)
    choice = backend.fastest_cpu_weights()
    assert (choice.dtype, choice.weight_format) == expected
    assert ("with native bf16" in choice.reason) == onednn_bf16


def test_strata_cpu_march_builds_the_kernels_for_another_cpu(monkeypatch, caplog):
    """STRATA_CPU_MARCH=haswell makes a server on an AVX-512 machine run the AVX2 code paths (benchmarks of the AVX2
    kind on another CPU); without it the build is native and per checkout."""
    from strata.kernels.cpu import build

    built = []
    monkeypatch.setattr(build, "_build", lambda name, march: built.append((name, march)))
    monkeypatch.setenv(build.MARCH_VARIABLE, "haswell")
    build._compile()
    monkeypatch.delenv(build.MARCH_VARIABLE)
    build._compile()
    assert built[0] == (f"strata_cpu_kernels_haswell_{build.cpu_fingerprint()}", "haswell")
    assert built[1][1] == "native" and built[1][0] != built[0][0]
    assert "-march=haswell" in caplog.text


def test_a_build_lock_left_by_a_killed_compile_is_removed_at_once_and_builders_take_turns(tmp_path):
    """A compile killed mid-way leaves torch's lock file; the next start waited on it (a restart within 10 minutes of
    the kill hung). Its builder's flock died with it, so the next builder removes the file at once; a live builder
    keeps the folder to itself until it is done."""
    import multiprocessing
    import os
    import threading

    from strata.kernels.cpu.build import building

    def killed_builder(folder):
        with building(folder):
            (folder / "lock").touch()         # torch's lock file, as a compile in progress holds it
            os._exit(1)                        # killed mid-compile: no cleanup runs

    child = multiprocessing.get_context("fork").Process(target=killed_builder, args=(tmp_path,))
    child.start()
    child.join(timeout=30)
    assert (tmp_path / "lock").exists()
    with building(tmp_path):
        assert not (tmp_path / "lock").exists()
        entered = threading.Event()

        def second_builder():
            with building(tmp_path):
                entered.set()

        threading.Thread(target=second_builder, daemon=True).start()
        assert not entered.wait(0.5)                  # a second builder waits while this one builds
    assert entered.wait(10)
