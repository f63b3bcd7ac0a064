"""Continuous batching: every step decodes every running sequence, then fills the token budget with prefill
chunks of running and newly admitted requests. When blocks run out the newest sequences are preempted:
swapped to host memory, or dropped and recomputed later.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.cache.kv.block_manager import BlockManager
from strata.cache.kv.swap import SwapSpace
from strata.server.engine.config import EngineConfig
from strata.server.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """What one engine step runs: prefill chunks (seq, n_tokens), then decodes; block copies come first."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    failed: list[Sequence] = field(default_factory=list)  # sequences that can never fit (alone too long)

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes)


@dataclass(slots=True)
class PreemptionStats:
    swap: int = 0
    recompute: int = 0
    swap_outs: int = 0  # blocks copied out
    swap_ins: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, swap: SwapSpace | None,
                 prefill_beside_decodes: int | None = None):
        self.config = config
        # prompt tokens a step takes while it decodes others (config.resolve_prefill_beside_decodes); None: no cap
        self.prefill_beside_decodes = prefill_beside_decodes or config.max_num_batched_tokens
        self.blocks = block_manager
        self.swap = swap
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the first to be preempted
        self.swapped: list[Sequence] = []
        self.stats = PreemptionStats()
        self.watermark = max(1, block_manager.num_blocks // 100)  # room kept so admissions don't starve decodes
        # cuts drafts to what pays for its rows, given the sampled sequences and the step's rows without drafts
        self.keep_paying_drafts: Callable[[list[Sequence], int], None] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        scheduled: set[Sequence] = set()
        # 1. Decodes, oldest first: each needs room for one more token, made by preempting the newest.
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below while making room for an older one
            if not self._make_room(seq, scheduled, batch):
                continue
            self.blocks.grow(seq, seq.num_computed_tokens + 1)
            batch.decodes.append(seq)
            scheduled.add(seq)
            budget -= 1
        # Prompt tokens beside decodes are capped: the step's time is each decoding request's inter-token time.
        held_back = max(0, budget - self.prefill_beside_decodes) if batch.decodes else 0
        budget -= held_back
        # 2. Prefill chunks of running sequences (their prompt blocks were allocated at admission).
        for seq in self.running:
            if seq in scheduled or budget <= 0 or seq.status is not SequenceStatus.RUNNING:
                continue
            budget -= self._schedule_chunk(seq, budget, batch, scheduled)
        # 3. Swapped sequences come back before new ones, oldest first, once every block they swapped out (a
        # prompt's whole table when preempted mid-prefill) and room for their next token are free. With nothing
        # running the reserve is theirs too: a victim held at most all blocks but one, so alone it always fits.
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            need = max(len(seq.swap_slots), self.blocks.blocks_needed(seq.num_computed_tokens + 1))
            reserve = self.watermark if self.running else 0
            if need > self.blocks.num_free_blocks - reserve:
                break
            self.swapped.pop(0)
            self._swap_in(seq, batch)
            budget -= self._schedule_chunk(seq, budget, batch, scheduled)
        # 4. Admit waiting requests while blocks, sequence slots and the token budget allow.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not self.swapped:
            seq = self.waiting[0]
            reserve = self.watermark if self.running else 0
            # prompt logprobs need every prompt position computed: such a sequence reuses no cached prefix
            reuse = seq.params.prompt_logprobs is None
            if not self.blocks.can_allocate(seq, len(seq.token_ids), reserve, reuse):
                if not self.running and self.blocks.blocks_needed(len(seq.token_ids)) > self.blocks.num_blocks:
                    self.waiting.popleft()
                    batch.failed.append(seq)
                    continue
                break
            self.waiting.popleft()
            hits = self.blocks.allocate(seq, len(seq.token_ids), reuse)
            if not seq.admitted:     # usage reports the prompt's cache hits at the first admission, not a recompute's
                seq.num_cached_tokens = hits
                seq.admitted = True
            seq.num_computed_tokens = hits
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._schedule_chunk(seq, budget, batch, scheduled)
        self._fit_drafts(batch, budget + held_back)
        return batch

    def _fit_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Drafts ride on what the step leaves: the token budget (at most speculative_max_step_tokens in the step)
        and free blocks above the watermark; they never preempt anything. A sequence is verified with its decode or
        its prompt's last chunk; any other keeps none."""
        used = self.config.max_num_batched_tokens - budget
        budget = min(budget, self.config.speculative_max_step_tokens - used)
        bs = self.blocks.block_size
        free_tokens = max(0, self.blocks.num_free_blocks - self.watermark) * bs
        for seq, n in batch.prefills:
            if seq.num_computed_tokens + n < len(seq.token_ids):
                seq.draft_token_ids = []
        sampled = [seq for seq, n in batch.prefills if seq.num_computed_tokens + n == len(seq.token_ids)]
        sampled += batch.decodes
        if self.keep_paying_drafts is not None:
            self.keep_paying_drafts(sampled, used)
        for seq in sampled:
            if not seq.draft_token_ids:
                continue
            room = len(seq.block_table) * bs - len(seq.token_ids)     # slots after its last token, already held
            keep = max(0, min(len(seq.draft_token_ids), budget, room + free_tokens))
            del seq.draft_token_ids[keep:]
            if keep:
                before = len(seq.block_table)
                self.blocks.grow(seq, len(seq.token_ids) + keep)
                free_tokens -= (len(seq.block_table) - before) * bs
                budget -= keep

    def _schedule_chunk(self, seq: Sequence, budget: int, batch: ScheduledBatch, scheduled: set[Sequence]) -> int:
        n = min(seq.num_uncomputed_tokens, budget)
        if n == seq.num_uncomputed_tokens == 1:  # only a sequence's last token is a decode (it gets sampled)
            self.blocks.grow(seq, seq.num_computed_tokens + 1)
            batch.decodes.append(seq)
        else:
            batch.prefills.append((seq, n))
        scheduled.add(seq)
        return n

    def _make_room(self, seq: Sequence, scheduled: set[Sequence], batch: ScheduledBatch) -> bool:
        """Preempt the newest unscheduled sequences until seq can take one more token; False if seq itself went."""
        while not self.blocks.can_grow(seq, seq.num_computed_tokens + 1):
            victims = [s for s in self.running if s not in scheduled and s is not seq]
            if victims:
                self.preempt(victims[-1], batch)
                continue
            if len(self.running) == 1:  # alone and out of blocks: it can never grow
                batch.failed.append(seq)
                self.running.remove(seq)
                return False
            self.preempt(seq, batch)
            return False
        return True

    def preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Swap seq's blocks to host memory when there is room, else drop them for recompute."""
        self.running.remove(seq)
        swap = self.swap
        if self.config.preemption_mode == "swap" and swap is not None and swap.can_hold(len(seq.block_table)):
            slots = swap.take(len(seq.block_table))
            batch.swap_out.extend(zip(seq.block_table, slots, strict=True))
            seq.swap_slots = slots
            self.stats.swap += 1
            self.stats.swap_outs += len(slots)
            self.blocks.free_sequence(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.swapped.sort(key=lambda s: s.arrival_time)
            return
        self.stats.recompute += 1
        self.blocks.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _swap_in(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.blocks.grow(seq, len(seq.swap_slots) * self.blocks.block_size)
        batch.swap_in.extend(zip(seq.swap_slots, seq.block_table, strict=True))
        self.stats.swap_ins += len(seq.swap_slots)
        self.swap.release(seq.swap_slots)
        seq.swap_slots = []
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=lambda s: s.arrival_time)

    def finish(self, seq: Sequence) -> None:
        """Release everything seq holds, wherever it is (running, waiting, swapped)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.swap_slots:
            self.swap.release(seq.swap_slots)
            seq.swap_slots = []
        self.blocks.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED
