"""Host-memory swap space: slots the size of a device block, so a swapped block is one copy each way."""

import torch

from strata.cache.kv.storage import KVLayout, KVStorage


class SwapSpace:
    """A pinned (when CUDA is there) host pool of block slots with a free list."""

    def __init__(self, layout: KVLayout, gib: float):
        self.num_slots = int(gib * 2**30) // layout.block_bytes
        self.storage = (
            KVStorage(layout, self.num_slots, torch.device("cpu"), pin_memory=torch.cuda.is_available())
            if self.num_slots else None
        )
        self.free_slots = list(range(self.num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_slots)

    def take(self, count: int) -> list[int]:
        if count > len(self.free_slots):
            raise RuntimeError("swap space exhausted (scheduler should have checked)")
        return [self.free_slots.pop() for _ in range(count)]

    def release(self, slots: list[int]) -> None:
        self.free_slots.extend(reversed(slots))
