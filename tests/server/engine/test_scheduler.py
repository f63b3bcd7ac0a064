"""The scheduler with the real block manager and swap space but no model: each step's bookkeeping is what the
engine does (chunks computed, one token sampled per finished prompt or decode, full blocks registered), so
preemption, swap and admission are checked over thousands of steps in milliseconds."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from strata.cache.kv.block_manager import BlockManager
from strata.cache.kv.storage import KVLayout
from strata.cache.kv.swap import SwapSpace
from strata.server.engine.config import EngineConfig
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.scheduler import Scheduler
from strata.server.engine.sequence import Sequence

BLOCK = 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BLOCK, kv_dtype="fp32")
TOKEN = 7
_ids = itertools.count()


def scheduler(num_blocks: int, mode: str = "swap", swap_slots: int = 0, **config) -> Scheduler:
    gib = swap_slots * LAYOUT.block_bytes / 2**30
    swap = SwapSpace(LAYOUT, gib) if swap_slots else None
    # swap mode needs swap space (EngineConfig refuses it without): none to swap to is recompute
    return Scheduler(EngineConfig(preemption_mode=mode if swap_slots else "recompute", swap_space=gib, **config),
                     BlockManager(num_blocks, BLOCK, True), swap)


def request(prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(f"r{next(_ids)}", list(prompt),
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler) -> tuple[bool, list[Sequence]]:
    """One engine step's bookkeeping; (whether anything ran, the sequences that finished)."""
    batch = s.schedule()
    done = list(batch.failed)
    sampled = []
    for seq, n in batch.prefills:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq.token_ids):
            sampled.append(seq)
    for seq in batch.decodes:
        seq.num_computed_tokens += 1
        sampled.append(seq)
    for seq in [seq for seq, _ in batch.prefills] + batch.decodes:
        s.blocks.register_computed(seq, seq.num_computed_tokens)
    for seq in sampled:
        seq.token_ids.append(TOKEN)
        if seq.num_output_tokens >= seq.params.max_tokens:
            done.append(seq)
    for seq in done:
        s.finish(seq)
    return not batch.empty, done


def run(s: Scheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 5000) -> list[Sequence]:
    """Steps until every request arrived and finished; fails on a step that schedules nothing while work waits."""
    finished: list[Sequence] = []
    pending = sum(map(len, arrivals.values()))
    for i in range(max_steps):
        for seq in arrivals.get(i, []):
            s.add(seq)
        ran, done = step(s)
        finished += done
        if len(finished) == pending:
            return finished
        assert ran or done or i < max(arrivals), f"step {i} ran nothing: {len(s.swapped)} swapped, " \
            f"{len(s.waiting)} waiting, {s.blocks.num_free_blocks} of {s.blocks.num_blocks} blocks free"
    raise AssertionError(f"{pending - len(finished)} requests unfinished after {max_steps} steps")


def assert_all_free(s: Scheduler) -> None:
    assert s.blocks.num_free_blocks == s.blocks.num_blocks and all(b.ref_count == 0 for b in s.blocks.blocks)
    assert s.swap is None or s.swap.num_free_slots == s.swap.num_slots
    assert not (s.running or s.waiting or s.swapped)


def test_a_sequence_swapped_out_mid_prefill_comes_back_with_its_whole_prompt_in_blocks():
    """Preempted at 26 of 64 prompt tokens it swaps out all 16 of its blocks; it comes back only when 16 are free
    (the check counted the blocks of 27 tokens, and taking 16 exhausted the pool: an engine crash)."""
    s = scheduler(20, swap_slots=64, max_num_batched_tokens=2, max_num_seqs=2)
    long_decode, chunked = request(range(10, 13), 60), request(range(20, 84), 4)
    finished = run(s, {0: [long_decode], 1: [chunked]})
    assert s.stats.swap >= 1
    assert all(seq.num_output_tokens == seq.params.max_tokens for seq in finished)
    assert_all_free(s)


def test_a_sequence_swapped_out_holding_nearly_the_whole_pool_comes_back_once_it_is_free():
    """Swapped out with 198 of 200 blocks it needs 199: with nothing else running the watermark's reserve is its
    own (before, it waited for 199 of the 198 blocks the reserve left, and the request behind it with it)."""
    s = scheduler(200, swap_slots=400)
    first = request(range(10, 13), 50)
    huge = request([11 + i % 500 for i in range(197 * BLOCK)], 10)
    small = request(range(300, 303), 2)
    finished = run(s, {0: [first], 1: [huge], 60: [small]})
    assert s.stats.swap >= 1 and {seq.request_id for seq in finished} == {first.request_id, huge.request_id,
                                                                          small.request_id}
    assert all(seq.num_output_tokens == seq.params.max_tokens for seq in finished)
    assert_all_free(s)


def test_cached_tokens_count_the_prompt_once_across_a_recompute():
    """Usage's cached_tokens are the prompt's prefix-cache hits at its first admission; a recompute that finds
    the request's own blocks again (prompt and output) does not raise it past the prompt."""
    s = scheduler(8, mode="recompute", max_num_batched_tokens=64)
    older = request(range(60, 63), 14)
    newer = request(range(10, 15), 24)
    finished = run(s, {0: [older], 1: [newer]})
    assert s.stats.recompute >= 1
    assert all(seq.num_cached_tokens <= seq.num_prompt_tokens for seq in finished)
    assert newer.num_cached_tokens == 0
    assert_all_free(s)


plans = st.lists(st.tuples(st.integers(0, 8), st.integers(1, 60), st.integers(1, 30), st.integers(0, 3)),
                 min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(plan=plans, num_blocks=st.integers(12, 40), mode=st.sampled_from(["swap", "recompute"]),
       swap_slots=st.sampled_from([4, 64]), budget=st.integers(1, 48), max_num_seqs=st.integers(1, 5),
       beside=st.sampled_from([None, 1, 3]))
def test_every_request_finishes_and_every_block_comes_back(plan, num_blocks, mode, swap_slots, budget,
                                                           max_num_seqs, beside):
    """Random arrivals, prompt lengths (some sharing a prefix), budgets and pool sizes: the scheduler never raises,
    never stalls with work waiting, and each request ends with its tokens or as too long for the pool alone."""
    s = scheduler(num_blocks, mode, swap_slots, max_num_batched_tokens=max(budget, max_num_seqs),
                  max_num_seqs=max_num_seqs)
    s.prefill_beside_decodes = beside or budget
    arrivals: dict[int, list[Sequence]] = {}
    for at, prompt_len, max_tokens, prefix in plan:
        prompt = [1000 + prefix] * (BLOCK * prefix) + list(range(prompt_len))
        arrivals.setdefault(at, []).append(request(prompt, max_tokens))
    finished = run(s, arrivals)
    for seq in finished:
        too_long = s.blocks.blocks_needed(len(seq.token_ids) + 1) > num_blocks
        assert seq.num_output_tokens == seq.params.max_tokens or too_long
        assert seq.num_cached_tokens <= seq.num_prompt_tokens
    assert_all_free(s)
