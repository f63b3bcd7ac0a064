"""Speculative decoding: greedy outputs with any drafts equal the outputs without; sampling with drafts keeps the
model's distribution; rejected drafts leave no blocks behind (aborts, preemption)."""

import itertools
import random

import pytest
import torch
from scipy.stats import chisquare

from strata.server.engine.config import EngineConfig
from strata.server.engine.llm_engine import LLMEngine
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.sequence import Sequence
from strata.server.engine.spec.cost import StepCost
from strata.server.engine.spec.ngram import NgramIndex, continuation
from strata.server.engine.spec.proposer import DraftProposer
from strata.server.engine.spec.state import DraftState

VOCAB = 512
PROMPTS = [[random.Random(i).randrange(3, VOCAB) for _ in range(5 + 11 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def corrupt(tokens: list[int], at: int | None) -> list[int]:
    """The draft wrong from position `at` on (None: right)."""
    return [t if at is None or j < at else (t + 1 + j) % VOCAB for j, t in enumerate(tokens)]


class OracleDrafts(DraftProposer):
    """Drafts made from the known plain output: right, wrong from a position on, or random; every step, whatever
    the acceptance (no adaptive pause), and only for the prompts in `drafted`."""

    def __init__(self, reference: dict[tuple, list[int]], mode: str, length: int = 5, drafted=None,
                 policy: str = "always"):
        super().__init__(("ngram",), length, 10**6, policy=policy)
        self.reference, self.mode, self.length, self.rng = reference, mode, length, random.Random(0)
        self.drafted = drafted

    def _draft(self, seq: Sequence) -> tuple[list[int], str | None]:
        key = tuple(seq.token_ids[:seq.num_prompt_tokens])
        if self.drafted is not None and key not in self.drafted:
            return [], None
        n = seq.num_output_tokens
        right = self.reference[key][n:n + self.length]
        if self.mode == "random":
            draft = [self.rng.randrange(VOCAB) for _ in range(self.length)]
        elif self.mode == "beyond-max-tokens":      # right, then past the end of what max_tokens allows
            draft = right + [self.rng.randrange(VOCAB) for _ in range(self.length)]
        else:
            draft = corrupt(right, {"right": None, "first": 0, "mid": len(right) // 2,
                                    "last": len(right) - 1}[self.mode])
        return (draft, "ngram") if draft else ([], None)


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    made = {}

    def make(model="tiny-llama", **overrides) -> LLMEngine:
        settings = dict(model=str(tiny_model_dirs[model]), dtype="fp32", kv_cache_memory="8MiB", block_size=8,
                        max_num_batched_tokens=64)
        settings.update(overrides)
        key = tuple(sorted(settings.items()))
        if key not in made:
            made[key] = LLMEngine(EngineConfig(**settings))
        return made[key]

    return make


def all_free(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def plain_outputs(engine: LLMEngine, params=GREEDY, prompts=PROMPTS) -> dict[tuple, list[int]]:
    engine.drafter = None
    return {tuple(p): o.token_ids for p, o in zip(prompts, engine.generate(prompts, params), strict=True)}


def drafted_outputs(engine: LLMEngine, drafter: DraftProposer, params=GREEDY, prompts=PROMPTS) -> list:
    engine.drafter = drafter
    try:
        return engine.generate(prompts, params)
    finally:
        engine.drafter = None


@pytest.mark.parametrize(("model", "mode"), [("tiny-llama", m) for m in ("right", "random", "first", "mid", "last",
                                                                        "beyond-max-tokens")]
                         + [("tiny-qwen2", "random"), ("tiny-qwen2", "mid")])
def test_greedy_outputs_with_drafts_equal_outputs_without(engines, model, mode):
    engine = engines(model)
    reference = plain_outputs(engine)
    drafter = OracleDrafts(reference, mode)
    outs = drafted_outputs(engine, drafter)
    assert [o.token_ids for o in outs] == list(reference.values())
    assert all(o.finish_reason == "length" for o in outs)
    totals = drafter.totals["ngram"]
    assert totals.drafts > 0
    if mode in ("right", "beyond-max-tokens"):
        assert totals.steps_saved > 0.6 * sum(len(t) for t in reference.values())
    if mode == "first":
        assert totals.accepted_tokens == 0
    assert all_free(engine)


def first_output(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    """The first step output of one request that carries tokens; the request is then aborted."""
    request_id = engine.add_request(prompt, params)
    outs = []
    while not any(o.new_token_ids for o in outs):
        outs += [o for o in engine.step() if o.request_id == request_id]
    engine.abort(request_id)
    return next(o for o in outs if o.new_token_ids)


def test_prompt_logprobs_come_with_a_first_output_that_is_a_verified_draft(engines):
    """The prompt's last token left to a step of its own (chunked prefill), whose draft is accepted: the first
    output carries several tokens, and the prompt's logprobs with them (they were dropped: 6 of 71 entries)."""
    prompt = PROMPTS[2]
    engine = engines(max_num_batched_tokens=len(prompt) - 1, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    engine.drafter = None
    plain = first_output(engine, prompt, params)
    assert len(plain.new_token_ids) == 1 and len(plain.prompt_logprobs) == len(prompt)
    engine.drafter = OracleDrafts({tuple(prompt): engine.generate([prompt], GREEDY)[0].token_ids}, "right")
    try:
        drafted = first_output(engine, prompt, params)
    finally:
        engine.drafter = None
    assert len(drafted.new_token_ids) > 1
    assert drafted.prompt_logprobs is not None
    assert [lp.token_id for lp in drafted.prompt_logprobs] == [lp.token_id for lp in plain.prompt_logprobs]
    assert [lp.logprob for lp in drafted.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in plain.prompt_logprobs[1:]], abs=1e-4)
    assert all_free(engine)


@pytest.mark.parametrize("settings", [
    dict(attention_backend="torch"),
    dict(kv_dtype="int8"),
    dict(attention_backend="triton-interpret"),
    dict(max_num_batched_tokens=16, max_num_seqs=8),        # chunked prefill
    dict(enable_prefix_caching=False, block_size=16),
])
def test_mixed_batches_match_plain_decoding_on_every_path(engines, settings):
    """Drafted and plain sequences in one step, with penalties and min_tokens (they see the draft prefix), through
    every decode kernel (the C++ one by default), INT8 KV, chunked prefill and with or without prefix caching."""
    engine = engines(**settings)
    tokens = 6 if settings.get("attention_backend") == "triton-interpret" else 18     # the interpreter is slow
    params = [SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=tokens, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=tokens, min_tokens=4, stop_token_ids=[7, 9, 11]),
              SamplingParams(temperature=0, max_tokens=tokens, frequency_penalty=0.8, ignore_eos=True)]
    reference = plain_outputs(engine, params)
    drafted = {tuple(PROMPTS[i]) for i in (0, 1, 3)}
    outs = drafted_outputs(engine, OracleDrafts(reference, "mid", length=3, drafted=drafted), params)
    assert [o.token_ids for o in outs] == list(reference.values())
    assert all_free(engine)


def test_cache_drafts_go_with_the_prompts_last_chunk(engines):
    """Cached answers as drafts (the 'cache' source): verified with the prompt's last prefill chunk, right or
    diverging midway, outputs unchanged; a right answer saves most steps."""
    engine = engines(max_num_batched_tokens=16, max_num_seqs=8)
    reference = plain_outputs(engine)
    for wrong_from in (None, 7):
        engine.drafter = DraftProposer(("cache",), 6, engine.max_model_len, policy="always")   # not timing-priced
        ids = []
        for prompt in PROMPTS:
            seq = engine.inputs.make_sequence(prompt, GREEDY)
            seq.draft_candidates = [corrupt(reference[tuple(prompt)], wrong_from), [1, 2, 3]]
            ids.append(engine.enqueue(seq))
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        assert [done[i].token_ids for i in ids] == list(reference.values())
        totals = engine.drafter.totals["cache"]
        if wrong_from is None:
            assert totals.steps_saved >= 0.7 * sum(len(t) for t in reference.values())
        assert all_free(engine)
    engine.drafter = None


def test_stop_strings_and_eos_inside_an_accepted_draft_end_where_plain_decoding_ends(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), dtype="fp32", kv_cache_memory="16MiB",
                                    block_size=8))
    prompt = "The quick brown fox jumps over the lazy dog and"
    long = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text, ids = long.text, long.token_ids
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cases = [SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
             SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[len(ids) // 2]]),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)]
    for params in cases:
        plain = engine.generate([prompt], params)[0]
        key = tuple(engine.inputs.make_sequence(prompt, params).token_ids)
        engine.drafter = OracleDrafts({key: ids}, "right", length=7)
        drafted = engine.generate([prompt], params)[0]
        engine.drafter = None
        assert (drafted.token_ids, drafted.text, drafted.finish_reason) == \
               (plain.token_ids, plain.text, plain.finish_reason)
        if params.logprobs:
            assert drafted.token_ids == ids
    assert all_free(engine)


def test_greedy_smollm2_with_prompt_lookup_drafts_is_identical(default_model_dir):
    """The real model with real n-gram drafts, on a prompt it copies from: same tokens, fewer steps."""
    text = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
            "do: once or twice she had peeped into the book her sister was reading, but it had no pictures or "
            "conversations in it.")
    prompt = f"{text}\n\nRepeat the text above word for word."
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = LLMEngine(EngineConfig(model=str(default_model_dir), kv_cache_memory="64MiB"))
    reference = plain.generate([prompt], params, chat=True)[0]
    # every draft verified: the "cost" policy prices drafts from wall-clock step times, so its count of saved steps
    # would depend on the host's load
    plain.drafter = DraftProposer(("ngram",), 5, plain.max_model_len, policy="always")
    drafted = plain.generate([prompt], params, chat=True)[0]
    assert drafted.token_ids == reference.token_ids
    assert plain.drafter.totals["ngram"].steps_saved >= 10
    assert all_free(plain)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_no_block_leaks_under_preemption_with_drafts(engines, mode):
    engine = engines(kv_cache_memory=str(12 * 2 * 2 * 2 * 16 * 8 * 4), preemption_mode=mode, swap_space=0.001)
    assert engine.block_manager.num_blocks == 12
    prompts = [p[:20] for p in PROMPTS] + [[5, 6, 7, 8, 9] * 3]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = plain_outputs(engine, params, prompts)
    before = engine.stats()[f"preemptions_{mode}"]
    outs = drafted_outputs(engine, OracleDrafts(reference, "mid", length=6), params, prompts)
    assert [o.token_ids for o in outs] == list(reference.values())
    assert engine.stats()[f"preemptions_{mode}"] > before
    assert all_free(engine)
    if engine.swap_space is not None:
        assert engine.swap_space.num_free_slots == engine.swap_space.num_slots


def test_abort_during_a_verify_step_frees_its_blocks_and_spares_the_others(engines, monkeypatch):
    engine = engines()
    reference = plain_outputs(engine)
    engine.drafter = OracleDrafts(reference, "mid")
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    real_run = engine.runner.run
    aborted = []

    def run_and_abort(batch):
        result = real_run(batch)
        victims = [s for s in batch.decodes if s.draft_token_ids and s.request_id == ids[2]]
        if victims and victims[0].num_output_tokens >= 6 and not aborted:
            # verified but not yet committed: it still holds the blocks grown for its draft
            assert len(victims[0].block_table) * 8 >= len(victims[0].token_ids) + len(victims[0].draft_token_ids)
            aborted.append(engine.abort(ids[2]))
        return result

    monkeypatch.setattr(engine.runner, "run", run_and_abort)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.drafter = None
    assert aborted == [True] and ids[2] not in done
    assert [done[i].token_ids for i in (ids[0], ids[1], ids[3])] == [reference[tuple(PROMPTS[i])] for i in (0, 1, 3)]
    assert all_free(engine)


def test_sampling_with_drafts_keeps_the_models_distribution(tmp_path):
    """Chi-square on a vocabulary of 8: the two-token outputs sampled with fixed drafts (accepted or rejected by the
    speculative-sampling rule) follow the model's exact distribution, computed by transformers."""
    from transformers import AutoModelForCausalLM

    from strata.models.named_shapes import hf_config_for

    config = hf_config_for("tiny-llama")
    config.vocab_size, config.bos_token_id, config.eos_token_id = 8, 0, 1
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():       # sharper logits than the random init, so that drafts are sometimes accepted
        hf.lm_head.weight.mul_(40)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompt, temperature, top_k = [2, 5, 3, 7], 0.9, 6

    def dist(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double() / temperature
        kth = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)

    first = dist(prompt)
    expected = torch.stack([first[a] * dist(prompt + [a]) for a in range(8)]).flatten()
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="fp32", kv_cache_memory="8MiB", block_size=8,
                                    max_num_seqs=256, max_num_batched_tokens=2048, speculative_max_step_tokens=2048))
    engine.drafter = OracleDrafts({tuple(prompt): [int(first.argmax()), 4]}, "right", length=2)
    engine.drafter.mode = "fixed"
    engine.drafter._draft = lambda seq: ([[int(first.argmax()), 4][seq.num_output_tokens]], "ngram")
    n = 2000
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=2, ignore_eos=True, seed=s)
              for s in range(n)]
    outs = engine.generate([prompt] * n, params)
    totals = engine.drafter.totals["ngram"]
    assert 0 < totals.accepted_tokens < totals.proposed_tokens        # both the accept and the reject path ran
    counts = torch.zeros(64, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[0] * 8 + o.token_ids[1]] += 1
    keep = expected * n >= 5                  # chi-square needs enough expected counts per cell
    observed = torch.cat([counts[keep], counts[~keep].sum().unsqueeze(0)])
    wanted = torch.cat([expected[keep], expected[~keep].sum().unsqueeze(0)])
    wanted = wanted / wanted.sum() * n
    assert chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3
    assert counts[~(expected > 0)].sum() == 0       # nothing top-k removes is ever sampled


def test_prompt_lookup_finds_the_latest_continuation():
    assert continuation([1, 2, 3, 4, 5, 9, 1, 2, 3], [1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert continuation([7, 1, 2, 8, 1, 2, 9, 1, 2], [7, 1, 2, 8, 1, 2, 9, 1, 2], 1) == [9]     # latest match
    assert continuation([1, 2], [1, 2], 3) == []                          # its own tail never matches
    assert continuation([5, 6, 7, 8], [0, 6, 7], 2) == [8]                # in another text (a cached answer)
    assert continuation([5, 6, 7, 8], [0, 0, 7], 2) == []                 # one shared token is not a match


def test_the_incremental_index_gives_the_rescan_s_continuation_at_every_length():
    """A sequence grown one token (or a few) at a time over a small vocabulary, so matches of every length occur."""
    rng = random.Random(4)
    for trial in range(20):
        tokens, index = [], NgramIndex()
        while len(tokens) < 300:
            tokens += [rng.randrange(6 if trial % 2 else 3) for _ in range(rng.choice([1, 1, 1, 3]))]
            k = rng.randrange(1, 6)
            assert index.continuation(tokens, k) == continuation(tokens, tokens, k), (trial, len(tokens))


def test_drafts_that_keep_failing_are_paused_longer_and_longer():
    state, tried = DraftState(), 0
    for _ in range(200):
        k = state.allowed(5)
        if k:
            tried += 1
            state.update(k, 0, 5)
    assert 5 <= tried <= 12          # about log2(200 / 32) + 200 / 32 tries, not 200
    state.update(1, 1, 5)            # an accepted draft ends the pause and lets the next one grow
    assert state.allowed(5) == 3
    state.update(3, 3, 5)
    assert state.allowed(5) == 5


def test_drafts_fill_a_step_only_up_to_its_token_cap(engines, monkeypatch):
    engine = engines(speculative_max_step_tokens=9)
    reference = plain_outputs(engine)
    engine.drafter = drafter = OracleDrafts(reference, "right")
    sizes = []
    real_run = engine.runner.run

    def run_and_count(batch):
        if not batch.prefills:
            sizes.append(sum(1 + len(s.draft_token_ids) for s in batch.decodes))
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", run_and_count)
    outs = engine.generate(PROMPTS, GREEDY)
    engine.drafter = None
    assert [o.token_ids for o in outs] == list(reference.values())
    assert max(sizes) == 9 and drafter.totals["ngram"].accepted_tokens > 0


def test_step_cost_is_fitted_from_steps_of_different_sizes():
    cost = StepCost()
    for _ in range(5):
        cost.observe(4, 0.05)
    assert cost.per_row is None                     # one step size says nothing about a row's price
    kept = [cost.keep(4, 4, [(0.1, 5), (0.9, 2)]) for _ in range(6)]
    assert kept == [[5, 2], [5, 2], [0, 0]] * 2     # unknown after steps of one size: every third step tries none
    assert StepCost().keep(4, 4, [(0.1, 5)]) == [5]     # nothing observed yet: every draft is tried
    rng = random.Random(0)
    for _ in range(200):
        rows = rng.randrange(1, 40)
        cost.observe(rows, 0.03 + 0.002 * rows + rng.uniform(-1e-4, 1e-4))
    assert cost.fixed == pytest.approx(0.03, rel=0.02) and cost.per_row == pytest.approx(0.002, rel=0.02)
    for _ in range(200):                            # a steady batch afterwards keeps the slope it learned
        cost.observe(16, 0.062)
    assert cost.per_row == pytest.approx(0.002, rel=0.05)


def test_a_step_cap_that_every_step_fills_still_lets_the_price_be_learned():
    """Drafts capped at 32 rows a step at 16 sequences: without the steps that verify no draft, every observed step
    would have 32 rows and the price of a row would stay unknown, so every draft would be kept (seen at batch 16)."""
    cost = StepCost()
    for _ in range(12):
        kept = cost.keep(16, 16, [(0.8, 5)] * 12)
        rows = min(32, 16 + sum(kept))
        cost.observe(rows, 0.0027 * rows)          # compute-bound: no fixed part, 2.7 ms a row
    assert cost.per_row == pytest.approx(0.0027, rel=0.01)
    assert cost.keep(16, 16, [(0.8, 5)] * 12) == [0] * 12     # at 2.7 ms a row and no fixed cost nothing pays


class PricedByTheTest(StepCost):
    def observe(self, rows: int, seconds: float) -> None:
        """Prices set by the test, not by this machine's step times."""


def expected_rate(cost: StepCost, rows: int, sampled: int, drafts, kept) -> float:
    tokens = sampled + sum(alpha ** j for (alpha, _), k in zip(drafts, kept, strict=True) for j in range(1, k + 1))
    return tokens / (cost.fixed + cost.per_row * (rows + sum(kept)))


@pytest.mark.parametrize("seed", range(20))
def test_kept_drafts_give_the_most_tokens_per_second_of_any_choice(seed):
    """Oracle: every choice of draft prefixes, enumerated; the kept one has the best expected tokens per second."""
    rng = random.Random(seed)
    cost = StepCost(fixed=rng.uniform(0.001, 0.05), per_row=rng.uniform(0.0005, 0.01))
    sampled = rng.randrange(1, 17)
    rows = sampled + rng.choice([0, 0, 24])          # sometimes a prompt chunk rides along
    drafts = [(rng.random(), rng.randrange(1, 5)) for _ in range(rng.randrange(1, 4))]
    kept = cost.keep(rows, sampled, drafts)
    assert all(0 <= k <= n for k, (_, n) in zip(kept, drafts, strict=True))
    best = max(expected_rate(cost, rows, sampled, drafts, choice)
               for choice in itertools.product(*(range(n + 1) for _, n in drafts)))
    assert expected_rate(cost, rows, sampled, drafts, kept) == pytest.approx(best, rel=1e-9)


def test_one_sequence_verifies_likely_drafts_and_a_full_cpu_batch_only_near_certain_ones():
    cost = StepCost(fixed=0.03, per_row=0.004)       # a CPU step: 30 ms fixed, 4 ms per row
    assert cost.keep(1, 1, [(0.5, 5)]) == [2]
    assert cost.keep(1, 1, [(0.2, 5)]) == [1]
    assert cost.keep(1, 1, [(0.05, 5)]) == [0]
    assert cost.keep(16, 16, [(0.5, 5)] * 16) == [0] * 16
    kept = cost.keep(16, 16, [(0.95, 5)] * 4 + [(0.5, 5)] * 12)
    assert all(k > 0 for k in kept[:4]) and kept[4:] == [0] * 12


def test_acceptance_starts_from_the_source_and_follows_the_request():
    drafter = DraftProposer(("ngram",), 5, 10**6)
    good, bad, fresh = (Sequence(f"r{i}", [1, 2, 3], GREEDY) for i in range(3))
    for seq in (good, bad, fresh):
        seq.draft_source = "ngram"
    assert drafter.acceptance(fresh) == 1.0          # nothing seen yet: every source gets tried
    for _ in range(10):
        drafter.record(good, 5, 5, 5)
        drafter.record(bad, 5, 0, 0)
    assert drafter.acceptance(bad) < 0.2 < 0.9 < drafter.acceptance(good)
    assert drafter.acceptance(fresh) == pytest.approx(51 / 61)     # the source's record: 50 of 60 tries


@pytest.mark.parametrize(("mode", "step_cost", "drafted_late"), [
    ("random", (1.0, 1e-4), True),        # overhead-bound: even poor drafts get a token
    ("random", (1e-4, 1.0), False),       # compute-bound: poor drafts stop being verified
    ("right", (1e-4, 1.0), True),         # ... but drafts that are always right go on
])
def test_the_cost_policy_drops_drafts_that_do_not_pay_and_outputs_stay_the_same(engines, monkeypatch, mode,
                                                                                 step_cost, drafted_late):
    engine = engines()
    reference = plain_outputs(engine)
    drafter = OracleDrafts(reference, mode, policy="cost")
    drafter.cost = PricedByTheTest(fixed=step_cost[0], per_row=step_cost[1])
    verified = []
    real_run = engine.runner.run

    def run_and_count(batch):
        if not batch.prefills:
            verified.append(sum(len(s.draft_token_ids) for s in batch.decodes))
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", run_and_count)
    outs = drafted_outputs(engine, drafter)
    assert [o.token_ids for o in outs] == list(reference.values())
    assert (sum(verified[len(verified) // 2:]) > 0) == drafted_late
    assert all_free(engine)
