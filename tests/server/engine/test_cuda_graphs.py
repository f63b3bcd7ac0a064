"""Decode CUDA graphs: bucket choice, when graphs are captured, and the padded static-buffer path they replay.

On CPU the padded path runs eagerly (what each graph records), on the torch and Triton-interpreter backends, and
must give the unpadded path's greedy tokens without touching any cache slot but its own and the scratch block's.
On CUDA the captured graphs must give the eager engine's tokens.
"""

import dataclasses
import os
import random

import pytest
import torch

from strata.kernels import AttentionMetadata
from strata.kernels.backend import TORCH
from strata.server.engine.config import EngineConfig
from strata.server.engine.cuda_graph_runner import DecodeGraphs, captures_decode_graphs, decode_buckets
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams

BACKENDS = ["torch", pytest.param("triton-interpret", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"))]


def make_engine(backend: str = "torch", kv_dtype: str = "fp32", name: str = "tiny-llama", **overrides) -> LLMEngine:
    settings = dict(model=None, load_format="dummy", model_config=name, dtype="fp32", kv_dtype=kv_dtype,
                    block_size=8, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=128,
                    kv_cache_memory="4MiB", attention_backend=backend, device="cpu")
    engine = LLMEngine(EngineConfig(**dict(settings, **overrides)))
    for layer in engine.model.model.layers:  # dummy weights give near-uniform attention: make the scores O(1)
        qkv = layer.self_attn.qkv_proj
        for t in (qkv.scales, qkv.mins) if hasattr(qkv, "scales") else (qkv.weight,):   # compact: scale the blocks
            if t is not None:
                t.mul_(8.0)
    return engine


def attach_padded_path(engine: LLMEngine) -> DecodeGraphs:
    """What the engine builds on CUDA, without capturing: pure-decode steps then run padded, eagerly."""
    graphs = DecodeGraphs(engine.model, engine.kv, engine.backend, engine.config.max_num_seqs, engine.max_model_len,
                          scratch_block=engine.block_manager.num_blocks, dtype=engine.dtype)
    engine.runner.graphs = graphs
    return graphs


def count_runs(graphs: DecodeGraphs) -> list[tuple[int, int]]:
    """Record (batch, bucket) of every padded step."""
    calls, run = [], graphs.run

    def counted(bucket, input_ids, positions, meta):
        calls.append((input_ids.shape[0], bucket))
        return run(bucket, input_ids, positions, meta)

    graphs.run = counted
    return calls


def test_buckets_double_up_to_max_num_seqs():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert decode_buckets(2) == [1, 2]
    assert decode_buckets(1) == [1]
    graphs = attach_padded_path(make_engine(max_num_seqs=6))
    assert graphs.buckets == [1, 2, 4, 6]
    assert [graphs.bucket_for(n, 1) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]
    assert graphs.max_blocks == 128 // 8
    assert graphs.bucket_for(1, graphs.max_blocks) == 1
    assert graphs.bucket_for(1, graphs.max_blocks + 1) is None  # a wider table than the static one: eager


def test_graphs_only_on_cuda_with_triton_and_not_enforce_eager():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton = dataclasses.replace(TORCH, name="triton")
    assert captures_decode_graphs(EngineConfig(), cuda, triton)
    assert not captures_decode_graphs(EngineConfig(enforce_eager=True), cuda, triton)
    assert not captures_decode_graphs(EngineConfig(), cpu, triton)
    assert not captures_decode_graphs(EngineConfig(), cuda, TORCH)  # the torch reference syncs on context lengths
    assert make_engine().runner.graphs is None


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,kv_dtype", [("tiny-llama", "fp32"), ("tiny-qwen2", "int8")])
def test_padded_decode_gives_the_unpadded_tokens(backend, name, kv_dtype):
    """Five sequences finishing one after another: batches 5, 4, 3, 2, 1 padded to buckets 8, 4, 4, 2, 1; long
    prompts are prefilled in chunks next to decodes (those steps stay eager)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 30, 9, 2)]
    max_tokens = [14, 11, 8, 5, 3]
    expected = generate(make_engine(backend, kv_dtype, name), prompts, max_tokens)
    engine = make_engine(backend, kv_dtype, name)
    runs = count_runs(attach_padded_path(engine))
    assert generate(engine, prompts, max_tokens) == expected
    assert {(5, 8), (4, 4), (3, 4), (2, 2), (1, 1)} <= set(runs)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_padded_decode_with_compact_weights_gives_the_unpadded_tokens(quantization):
    """Q8_0 / Q4 layers, lm_head included, hold integer codes: the static hidden buffer must take the activations'
    dtype, not lm_head's weight dtype (on the H200 that cast every graph-decoded token to 0)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 9)]
    max_tokens = [9, 6, 3]
    expected = generate(make_engine(quantization=quantization), prompts, max_tokens)
    engine = make_engine(quantization=quantization)
    assert engine.model.lm_head.weight.dtype in (torch.int8, torch.uint8)        # what the buffer must not follow
    runs = count_runs(attach_padded_path(engine))
    assert generate(engine, prompts, max_tokens) == expected
    assert {(3, 4), (2, 2), (1, 1)} <= set(runs)


def decode_metadata(slots: list[int], context_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    def ints(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype)

    return AttentionMetadata(
        slot_mapping=ints(slots), num_prefill_tokens=0, prefill_cu_seqlens_q=ints([0], torch.int32),
        prefill_context_lens=ints([], torch.int32), prefill_block_tables=ints([[]], torch.int32).reshape(0, 0),
        decode_context_lens=ints(context_lens, torch.int32), decode_block_tables=ints(tables, torch.int32),
        prefill_cu_seqlens_q_host=[0], prefill_context_lens_host=[],
    )


def cache_views(kv) -> list[torch.Tensor]:
    """Copies of every layer's K, V (and INT8 scales), each indexed [block, offset, ...]."""
    return [t.clone() for layer in kv.layers for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)
            if t is not None]


def changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[tuple[int, int]]:
    """(block, offset) pairs whose K, V or scale differ, in any layer."""
    changed = set()
    for old, new in zip(before, after, strict=True):
        diff = (new != old).reshape(*new.shape[:2], -1).any(-1)
        changed |= {tuple(ix) for ix in diff.nonzero().tolist()}
    return changed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
@torch.inference_mode()
def test_padded_rows_write_only_the_scratch_block(backend, kv_dtype):
    """A batch of 8, then one of 3 in the same bucket: rows 3..7 still hold the first batch's slots, and must write
    nowhere but the scratch block (the cache is re-randomised in between so any stale write would show)."""
    engine = make_engine(backend, kv_dtype)
    graphs = attach_padded_path(engine)
    kv, scratch = engine.kv, engine.block_manager.num_blocks
    gen = torch.Generator().manual_seed(0)

    def randomise():
        for layer in kv.layers:
            for t in (layer.k, layer.v):
                t.copy_(torch.randint(-100, 100, t.shape, generator=gen) if kv_dtype == "int8"
                        else torch.randn(t.shape, generator=gen))
            for t in (layer.k_scale, layer.v_scale):
                if t is not None:
                    t.copy_(torch.rand(t.shape, generator=gen) / 50 + 1e-3)

    def step(n: int, position: int) -> torch.Tensor:
        # Sequence i owns blocks 2i and 2i + 1; its next token sits at `position`.
        tables = [[2 * i, 2 * i + 1] for i in range(n)]
        slots = [t[position // 8] * 8 + position % 8 for t in tables]
        ids = torch.tensor([rng.randrange(3, 512) for _ in range(n)])
        return graphs.run(graphs.bucket_for(n, 2), ids, torch.full((n,), position), decode_metadata(
            slots, [position + 1] * n, tables))

    rng = random.Random(0)
    randomise()
    step(8, 11)
    randomise()
    before = cache_views(kv)
    hidden = step(3, 12)
    assert hidden.shape[0] == 3 and graphs.block_tables.shape == (8, 16)
    changed = changed_slots(before, cache_views(kv))
    real = {(2 * i + 1, 12 % 8) for i in range(3)}
    assert real <= changed  # the three real tokens were written ...
    assert {b for b, _ in changed - real} == {scratch}  # ... and padding wrote only into the scratch block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name,kv_dtype", [("tiny-llama", "fp32"), ("tiny-qwen2", "int8")])
def test_cuda_graphs_give_the_eager_tokens(name, kv_dtype):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 30, 9, 2, 64, 40, 3, 11)]
    max_tokens = [20, 9, 7, 5, 3, 16, 12, 30, 1]

    def engine(enforce_eager: bool) -> LLMEngine:
        # max_model_len 1024: the graphs' static tables make the decode kernel split short contexts (split-K)
        return make_engine("auto", kv_dtype, name, device="cuda", enforce_eager=enforce_eager, max_num_seqs=12,
                           max_model_len=1024)

    eager = engine(True)
    assert eager.runner.graphs is None
    expected = generate(eager, prompts, max_tokens)
    graphed = engine(False)
    assert sorted(graphed.runner.graphs.graphs) == [1, 2, 4, 8, 12]
    runs = count_runs(graphed.runner.graphs)
    assert generate(graphed, prompts, max_tokens) == expected
    assert len(runs) >= 10


def swap_linears(engine: LLMEngine, make) -> None:
    """Replace every nn.Linear-like layer of the engine's model (lm_head included) by make(name, layer)."""
    from strata.models.compact_linear import CompactLinear

    targets = [(name, m) for name, m in engine.model.named_modules() if isinstance(m, torch.nn.Linear | CompactLinear)]
    assert len(targets) == 1 + 4 * len(engine.model.model.layers)
    for name, layer in targets:
        parent, _, child = name.rpartition(".")
        setattr(engine.model.get_submodule(parent), child, make(name, layer))


def compact_and_dense_engines(quantization: str) -> tuple[LLMEngine, LLMEngine]:
    """Two eager CUDA engines of the same dummy weights: one with Q8_0 / Q4_1 CompactLinear layers (the Triton
    kernel), one with those blocks widened once into dense fp32 nn.Linear layers. fp32 activations: both compute the
    same products. Built by swapping layers in, since --quantization refuses CUDA until these GPU tests have passed
    on a GPU (the graph case failed on the H200 on 2026-12-04: every graph-decoded token came out 0, which the
    padded-path test on CPU reproduced and traced to the static hidden buffer taking lm_head's int8 weight dtype)."""
    from strata.models.compact_linear import CompactLinear

    settings = dict(model=None, load_format="dummy", model_config="tiny-llama", dtype="fp32", block_size=8,
                    max_num_seqs=8, max_model_len=256, kv_cache_memory="16MiB", device="cuda",
                    enable_prefix_caching=False, enforce_eager=True)
    compact, dense = LLMEngine(EngineConfig(**settings)), LLMEngine(EngineConfig(**settings))
    swap_linears(compact, lambda name, layer: CompactLinear.from_linear(layer, quantization).to("cuda"))
    layers = dict(compact.model.named_modules())

    def widened(name: str, layer: torch.nn.Linear) -> torch.nn.Linear:
        layer.weight.data = layers[name].unpacked_weight()
        return layer

    swap_linears(dense, widened)
    return compact, dense


PROMPTS = [[random.Random(11 + n).randrange(3, 512) for _ in range(n)] for n in (5, 17, 30, 9, 2, 64)]
MAX_TOKENS = [20, 9, 7, 5, 3, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton weight kernel needs a GPU")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_eagerly_give_the_dense_dequantized_tokens(quantization):
    compact, dense = compact_and_dense_engines(quantization)
    assert generate(compact, PROMPTS, MAX_TOKENS) == generate(dense, PROMPTS, MAX_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton weight kernel needs a GPU")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_in_cuda_graphs_give_the_dense_dequantized_tokens(quantization):
    compact, dense = compact_and_dense_engines(quantization)
    graphs = attach_padded_path(compact)
    graphs.capture()
    assert generate(compact, PROMPTS, MAX_TOKENS) == generate(dense, PROMPTS, MAX_TOKENS)
