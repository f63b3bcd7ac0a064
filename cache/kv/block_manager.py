"""Block pool with reference counts, per-sequence block tables and automatic prefix caching.

Full blocks are named by a hash chain (xxhash of the parent's hash + the block's token ids), so a new request
whose prompt starts like an earlier one reuses those blocks. A freed hashed block stays reusable until the
pool needs it back (least recently freed goes first).
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import xxhash


class BlockTableOwner(Protocol):
    """What the block manager needs of a sequence (the engine's Sequence satisfies it)."""

    token_ids: list[int]
    block_table: list[int]
    block_hashes: list[int]      # chain hashes of its full blocks' tokens, filled once (they never change)
    num_hashed_blocks: int       # leading blocks of its table registered in the prefix cache


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = -1
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0  # requests that reused at least one block
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass(slots=True)
class BlockManager:
    """Hands out blocks; never leaks them: `num_free_blocks == num_blocks` once every sequence is freed."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    namespace: str = ""  # model identity: prefixes are never shared across models or KV formats
    blocks: list[Block] = field(init=False)
    free: "OrderedDict[int, None]" = field(init=False)  # front = first to be reused
    cached: dict[int, int] = field(init=False)  # block hash -> block id
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    root_hash: int = field(init=False)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict.fromkeys(range(self.num_blocks))
        self.cached = {}
        self.root_hash = xxhash.xxh3_64_intdigest(self.namespace.encode())

    # -- accounting -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain_hash(self, parent: int, token_ids: tuple[int, ...]) -> int:
        h = xxhash.xxh3_64()
        h.update(parent.to_bytes(8, "little"))
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
        return h.intdigest()

    def block_tokens(self, seq: BlockTableOwner, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def block_hashes(self, seq: BlockTableOwner, num_blocks: int) -> list[int]:
        """The chain hashes of seq's first num_blocks (full) blocks, computed once per block and kept on seq: a
        request that waits for blocks is matched against the prefix cache every step without hashing again."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(self.chain_hash(hashes[-1] if hashes else self.root_hash, self.block_tokens(seq, i)))
        return hashes[:num_blocks]

    # -- allocation -------------------------------------------------------------------------------------
    def match_prefix(self, seq: BlockTableOwner, reuse: bool = True) -> list[int]:
        """Cached blocks equal to the start of seq's tokens (never its last token: that one must be computed);
        none when not `reuse` (a sequence that needs every prompt position computed)."""
        if not self.enable_prefix_caching or not reuse:
            return []
        hits = []
        for i, h in enumerate(self.block_hashes(seq, (len(seq.token_ids) - 1) // self.block_size)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != self.block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: BlockTableOwner, num_tokens: int, reserve: int = 0, reuse: bool = True) -> bool:
        """Whether blocks for seq's first num_tokens tokens fit, keeping `reserve` blocks free for decodes."""
        hits = self.match_prefix(seq, reuse)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(num_tokens) - len(hits)
        return needed + reused_free <= self.num_free_blocks - reserve

    def allocate(self, seq: BlockTableOwner, num_tokens: int, reuse: bool = True) -> int:
        """Give seq blocks for its first num_tokens tokens; return how many leading tokens are already cached
        (none when not `reuse`)."""
        if seq.block_table:
            raise RuntimeError("sequence already holds blocks")
        hits = self.match_prefix(seq, reuse)
        if self.enable_prefix_caching:
            self.stats.queries += 1
            self.stats.queried_tokens += len(seq.token_ids)
            self.stats.hits += bool(hits)
            self.stats.hit_tokens += len(hits) * self.block_size
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = len(hits)
        for _ in range(self.blocks_needed(num_tokens) - len(hits)):
            seq.block_table.append(self._take_free_block())
        return len(hits) * self.block_size

    def can_grow(self, seq: BlockTableOwner, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: BlockTableOwner, num_tokens: int) -> None:
        """Make seq's block table cover num_tokens tokens."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def truncate(self, seq: BlockTableOwner, num_tokens: int) -> None:
        """Give back the blocks past seq's first num_tokens tokens (a rejected draft's KV). They were grown for
        tokens never registered in the prefix cache (only computed ones are), so they go straight back to the pool."""
        keep = self.blocks_needed(num_tokens)
        if keep < seq.num_hashed_blocks:
            raise RuntimeError("cannot truncate into blocks registered in the prefix cache")
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def _take_free_block(self) -> int:
        if not self.free:
            raise RuntimeError("KV block pool exhausted (scheduler should have checked)")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1 and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = -1, (), 1
        return block_id

    def register_computed(self, seq: BlockTableOwner, num_computed_tokens: int) -> None:
        """Hash the blocks that just became full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        hashes = self.block_hashes(seq, full)
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if hashes[i] not in self.cached:
                block.hash, block.token_ids = hashes[i], self.block_tokens(seq, i)
                self.cached[hashes[i]] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free_sequence(self, seq: BlockTableOwner) -> None:
        """Drop seq's references; blocks nobody uses go back to the pool (hashed ones stay reusable)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash == -1:
                    self.free.move_to_end(block_id, last=False)  # nothing to keep: reuse it first
        seq.block_table.clear()
        seq.num_hashed_blocks = 0
