"""Engine behaviour on tiny models: block accounting, sampling, stop conditions, bad input."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.cache.kv.storage import KVLayout
from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine, RequestError
from strata.server.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_engine_factory(tiny_model_dirs):
    def make(**overrides) -> LLMEngine:
        settings_ = dict(model=str(tiny_model_dirs["tiny-llama"]), dtype="fp32", kv_cache_memory="8MiB",
                         block_size=8, max_num_batched_tokens=64)
        settings_.update(overrides)
        return LLMEngine(EngineConfig(**settings_))

    return make


def all_blocks_free(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


request_plan = st.lists(
    st.tuples(
        st.integers(0, 6),  # step at which the request arrives
        st.lists(st.integers(3, 500), min_size=1, max_size=90),  # prompt
        st.integers(1, 40),  # max_tokens
        st.one_of(st.none(), st.integers(0, 12)),  # abort after this many steps, or never
    ),
    min_size=1, max_size=10,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=request_plan, num_blocks=st.integers(14, 40), prefix=st.booleans(), mode=st.sampled_from(["recompute", "swap"]))
def test_every_block_is_free_after_any_mix_of_finished_and_aborted(tiny_engine_factory, plan, num_blocks, prefix, mode):
    block_bytes = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, kv_dtype="fp32").block_bytes
    engine = tiny_engine_factory(kv_cache_memory=str(num_blocks * block_bytes),
                                 enable_prefix_caching=prefix, preemption_mode=mode, swap_space=0.0005)
    assert engine.block_manager.num_blocks == num_blocks
    pending = sorted(enumerate(plan), key=lambda item: item[1][0])
    ids: dict[int, str] = {}
    finished: set[str] = set()
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            index, (_, prompt, max_tokens, _) = pending.pop(0)
            try:
                ids[index] = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                       ignore_eos=True))
            except RequestError:
                assert engine.block_manager.blocks_needed(len(prompt) + 1) > num_blocks
        for index, (arrival, _, _, abort_after) in enumerate(plan):
            if index in ids and abort_after is not None and step == arrival + abort_after:
                engine.abort(ids[index])
        finished.update(o.request_id for o in engine.step() if o.finished)
        step += 1
        assert step < 5000
    assert all_blocks_free(engine)
    if engine.swap_space is not None:
        assert engine.swap_space.num_free_slots == engine.swap_space.num_slots


def test_seeded_sampling_is_reproducible(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompt = list(range(10, 40))

    def run(seed):
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=24, seed=seed, ignore_eos=True)
        return engine.generate([prompt], params)[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
    # A seeded request gives the same tokens whatever else shares its batch.
    alone = run(3)
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=3, ignore_eos=True, top_p=0.9, top_k=50),
              SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)]
    assert engine.generate([prompt, list(range(50, 70))], params)[0].token_ids == alone


def test_max_tokens_and_stop_token_ids(tiny_engine_factory):
    engine = tiny_engine_factory()
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"
    stopper = out.token_ids[4]
    first = out.token_ids.index(stopper)
    out2 = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                                       stop_token_ids=[stopper]))[0]
    assert out2.token_ids == out.token_ids[: first + 1] and out2.finish_reason == "stop"


def test_eos_and_stop_strings_on_the_default_model(default_model_dir):
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="fp32", kv_cache_memory="64MiB"))
    out = engine.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=64),
                          chat=True)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == engine.tokenizer.eos_token_id
    assert "Paris" in out.text
    stopped = engine.generate(["What is the capital of France?"],
                              SamplingParams(temperature=0, max_tokens=64, stop=["Paris"]), chat=True)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == out.text[: out.text.index("Paris")]
    assert all_blocks_free(engine)


def streamed(engine: LLMEngine, prompt: str, params: SamplingParams) -> tuple[str, str]:
    """(the new_text pieces joined, the final text) of one chat request stepped to the end."""
    request_id = engine.add_request(prompt, params, chat=True)
    pieces = []
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                pieces.append(out.new_text)
                if out.finished:
                    return "".join(pieces), out.text


def test_streamed_text_never_shows_what_a_stop_string_cuts(default_model_dir):
    """A stop string over several tokens ('Paris is'): what was streamed before it completed is held back, so the
    pieces add up to the final text; include_stop_str_in_output keeps the stop string."""
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="fp32", kv_cache_memory="64MiB"))
    question = "What is the capital of France?"
    full = engine.generate([question], SamplingParams(temperature=0, max_tokens=64), chat=True)[0].text
    stop = full[full.index("France is") + len("France "):][:9]          # "is Paris." spans tokens
    cut = full[:full.index(stop)]
    assert streamed(engine, question, SamplingParams(temperature=0, max_tokens=64, stop=[stop])) == (cut, cut)
    kept = SamplingParams(temperature=0, max_tokens=64, stop=[stop], include_stop_str_in_output=True)
    assert streamed(engine, question, kept) == (cut + stop, cut + stop)
    # completed before min_tokens, the stop string does not count later either: the answer is the one without it
    tokens = engine.generate([question], SamplingParams(temperature=0, max_tokens=64), chat=True)[0].token_ids
    completed_at = next(k for k in range(1, len(tokens) + 1) if stop in engine.tokenizer.decode(tokens[:k]))
    unstopped = engine.generate([question], SamplingParams(temperature=0, max_tokens=64, min_tokens=completed_at + 1),
                                chat=True)[0].text
    assert unstopped.count(stop) == 1
    late = SamplingParams(temperature=0, max_tokens=64, stop=[stop], min_tokens=completed_at + 1)
    assert streamed(engine, question, late) == (unstopped, unstopped)
    assert all_blocks_free(engine)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_without_leaking_blocks(tiny_engine_factory):
    engine = tiny_engine_factory(max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=4)
    for prompt, message in [([], "empty"), ([1] * 200, "context"), ([10**6], "token ids"), ("  ", "empty")]:
        with pytest.raises(RequestError, match=message):
            engine.add_request(prompt, params)
    assert not engine.has_unfinished() and all_blocks_free(engine)
    assert engine.generate([[3, 4, 5]], params)[0].finish_reason == "length"  # still serving


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_abort_frees_blocks_mid_generation(tiny_engine_factory):
    engine = tiny_engine_factory()
    rid = engine.add_request(list(range(3, 60)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort(rid) and not engine.abort(rid)
    assert all_blocks_free(engine) and not engine.has_unfinished()


def test_a_kv_pool_smaller_than_the_context_serves_the_context_it_holds(tiny_engine_factory, caplog):
    """A pool that holds fewer tokens than the context: the context served is what it holds, and a warning says so
    (the model's whole context was advertised while answers ended "length" where the pool ran out). A prompt must
    leave room for one new token, the check the HTTP process runs too with the ModelInfo's figures."""
    block_bytes = tiny_engine_factory().kv_layout.block_bytes
    with caplog.at_level("WARNING"):
        engine = tiny_engine_factory(kv_cache_memory=str(4 * block_bytes), max_model_len=128)
    assert engine.info.kv_capacity_tokens == engine.kv_capacity_tokens == 4 * 8 == engine.info.max_model_len
    assert "holds 32 tokens, fewer than the context of 128" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=1)
    with pytest.raises(RequestError, match="32"):
        engine.add_request([3] * 32, params)
    assert engine.generate([[3] * 31], params)[0].finish_reason == "length"


def test_model_is_built_with_its_context_length(tiny_model_dirs, tiny_engine_factory):
    """The rotary table is made for max_model_len when the model is built, never swapped in afterwards."""
    import torch

    from strata.models.loader import load_model

    path = tiny_model_dirs["tiny-llama"]
    model = load_model(path, "auto", None, torch.float32, torch.device("cpu"), max_model_len=48)
    assert model.max_model_len == 48 and model.model.rope.cos.shape[0] == 48
    own = load_model(path, "auto", None, torch.float32, torch.device("cpu"))
    assert own.max_model_len == own.config.max_position_embeddings == own.model.rope.cos.shape[0]
    too_long = load_model(path, "auto", None, torch.float32, torch.device("cpu"), max_model_len=10**6)
    assert too_long.max_model_len == own.config.max_position_embeddings
    engine = tiny_engine_factory(max_model_len=100)
    assert engine.max_model_len == engine.info.max_model_len == engine.model.model.rope.cos.shape[0] == 100


def test_sequences_are_equal_only_to_themselves():
    """The scheduler keeps sequences in sets: two requests with the same tokens and settings are still two."""
    from strata.server.engine.sequence import Sequence

    a, b = Sequence("r", [1, 2, 3], SamplingParams()), Sequence("r", [1, 2, 3], SamplingParams())
    assert a != b and a == a and len({a, b}) == 2
    assert b not in [a]


def test_engine_fingerprint_names_both_the_prefix_cache_and_the_request_cache_partition(tiny_engine_factory):
    fp32, int8 = tiny_engine_factory(), tiny_engine_factory(kv_dtype="int8")
    assert fp32.fingerprint != int8.fingerprint                         # another KV format never shares blocks
    assert fp32.info.model_key == f"{fp32.model_id}@{fp32.fingerprint}"
    assert tiny_engine_factory().fingerprint == fp32.fingerprint        # same weights and formats: same key
    from strata.cache.kv.block_manager import BlockManager

    assert fp32.block_manager.root_hash == BlockManager(1, 8, namespace=fp32.fingerprint).root_hash


def test_a_long_prompt_prefills_in_small_chunks_only_while_others_decode(tiny_engine_factory):
    """A step's time is the inter-token time of every request decoding in it: beside decodes a prompt gets at most
    prefill_beside_decodes tokens a step; alone it gets the whole budget. The answers do not change."""
    engine = tiny_engine_factory(kv_cache_memory="32MiB", max_num_batched_tokens=256, prefill_beside_decodes=16,
                                 enable_prefix_caching=False)      # the second run must prefill again
    assert engine.scheduler.prefill_beside_decodes == 16
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    long_prompt = [(i * 7) % 400 + 3 for i in range(200)]
    alone = engine.generate([long_prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    short = engine.add_request([5, 6, 7], greedy)
    engine.step()                                            # the short one has its first token: it decodes now
    long_id = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    chunks, outputs = [], {}
    while long_id not in outputs or not outputs[long_id].finished:
        seq = engine.requests[long_id]
        before = seq.num_computed_tokens
        for out in engine.step():
            outputs[out.request_id] = out
        if long_id in engine.requests and engine.requests[long_id].num_output_tokens == 0:
            chunks.append(engine.requests[long_id].num_computed_tokens - before)
    assert chunks and max(chunks) <= 16                     # never more than the cap while the short one decodes
    assert outputs[long_id].token_ids == alone.token_ids
    engine.abort(short)
    solo = tiny_engine_factory(max_num_batched_tokens=256, prefill_beside_decodes=16)
    first = solo.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert solo.step()[0].request_id == first              # nothing decoding: the whole prompt in one step
