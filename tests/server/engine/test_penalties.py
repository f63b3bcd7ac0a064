"""The batched penalties and min_tokens against a plain per-sequence loop written from vLLM's and OpenAI's
definitions, and through the sampler (greedy picks change; settings of one row never touch another)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.server.engine.min_tokens import suppress_early_stops
from strata.server.engine.penalties import apply_penalties
from strata.server.engine.sampler import RowError, sample
from strata.server.engine.sampling_params import REPETITION_PENALTY_RANGE, InvalidParam, SamplingParams
from strata.server.engine.sequence import Sequence

VOCAB = 12


def reference(logits: list[float], prompt: list[int], output: list[int], params: SamplingParams) -> list[float]:
    """repetition: seen in prompt or output -> positive / r, negative * r; then frequency * count and presence * 1
    for tokens in the output are subtracted."""
    out = list(logits)
    for tok in range(len(out)):
        if tok in prompt or tok in output:
            r = params.repetition_penalty
            out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
        count = output.count(tok)
        out[tok] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def seq(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    s = Sequence("r", prompt + output, params)
    s.num_prompt_tokens = len(prompt)
    return s


ids = st.lists(st.integers(0, VOCAB - 1), max_size=8)
penalties = st.builds(SamplingParams, repetition_penalty=st.floats(0.1, 3.0), presence_penalty=st.floats(-2, 2),
                      frequency_penalty=st.floats(-2, 2))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), ids,
                               st.one_of(st.just(SamplingParams()), penalties)), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_batched_penalties_match_the_reference(rows, seed):
    torch.manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB) * 4
    got = apply_penalties(logits, [seq(p, o, params) for p, o, params in rows])
    for i, (prompt, output, params) in enumerate(rows):
        want = reference(logits[i].tolist(), prompt, output, params)
        assert got[i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_no_penalty_returns_the_logits_untouched():
    logits = torch.randn(2, VOCAB)
    assert apply_penalties(logits, [seq([1], [2], SamplingParams()), seq([3], [], SamplingParams())]) is logits


def test_penalties_change_greedy_choices_per_row_only():
    """Row 0 repeats token 5 with a heavy frequency penalty: greedy moves to the runner-up; row 1 (no penalty, same
    logits and history) keeps token 5."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 7] = 3.0, 2.0
    tokens = sample(logits, [seq([1], [5, 5], SamplingParams(temperature=0, frequency_penalty=1.0)),
                             seq([1], [5, 5], SamplingParams(temperature=0))])
    assert tokens == [7, 5]


@settings(max_examples=100, deadline=None)
@given(penalty=st.one_of(st.sampled_from(REPETITION_PENALTY_RANGE), st.floats(*REPETITION_PENALTY_RANGE)),
       temperature=st.floats(1e-5, 2.0), scale=st.floats(1e-3, 1e4), seed=st.integers(0, 2**16))
def test_extreme_repetition_penalties_still_sample(penalty, temperature, scale, seed):
    """At the ends of the accepted range, with logits up to 1e4 and a temperature of 1e-5, every row samples.
    Outside it (5e-324 is 0 in fp32: seen tokens' logits divided to inf) the request is refused."""
    with pytest.raises(InvalidParam, match="repetition_penalty"):
        SamplingParams(repetition_penalty=5e-324)
    torch.manual_seed(seed)
    logits = torch.randn(2, VOCAB) * scale
    params = SamplingParams(temperature=temperature, seed=seed, repetition_penalty=penalty)
    tokens = sample(logits, [seq([1, 2], [3], params), seq([4], [5, 5], params)])
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens)


def test_min_tokens_holds_eos_and_stop_ids_back_until_reached():
    logits = torch.zeros(3, VOCAB)
    logits[:, 0], logits[:, 4], logits[:, 9] = 5.0, 4.0, 3.0       # 0 is EOS, 4 a stop token id
    eos = frozenset({0})
    early = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    rows = [seq([1], [2], early), seq([1], [2, 3, 6], early),
            seq([1], [2], SamplingParams(temperature=0, min_tokens=3, ignore_eos=True))]
    assert sample(logits, rows, eos) == [9, 0, 0]
    masked = suppress_early_stops(logits, rows, eos)
    assert masked[0, 0] == masked[0, 4] == float("-inf") and masked[1].isfinite().all()


def test_min_tokens_that_leaves_nothing_fails_that_row_alone():
    logits = torch.zeros(2, VOCAB)
    every = SamplingParams(temperature=0.5, seed=1, min_tokens=2, stop_token_ids=list(range(VOCAB)))
    tokens = sample(logits, [seq([1], [], every), seq([1], [], SamplingParams(temperature=0.5, seed=1))])
    assert isinstance(tokens[0], RowError) and isinstance(tokens[1], int)


@pytest.mark.parametrize("kwargs,param", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop=["x"] * 17), "stop"),
])
def test_out_of_range_settings_name_their_field(kwargs, param):
    with pytest.raises(InvalidParam) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_stop_token_ids_must_be_in_the_vocabulary():
    SamplingParams(stop_token_ids=[VOCAB - 1]).check_vocab(VOCAB)
    with pytest.raises(InvalidParam):
        SamplingParams(stop_token_ids=[VOCAB]).check_vocab(VOCAB)


def test_stop_token_ids_are_bounded_in_the_engine_too():
    """The engine checks each sampled token against the list: an engine client other than the HTTP API must not
    be able to hand it 140k of them either."""
    SamplingParams(stop_token_ids=list(range(1024)))
    with pytest.raises(InvalidParam, match="at most 1024"):
        SamplingParams(stop_token_ids=list(range(1025)))
