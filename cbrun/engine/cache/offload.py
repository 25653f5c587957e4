"""What happens to a preempted request: CPU offload, or soft reset (recompute later).

Offload copies the request's KV pages to a CPU swap pool and brings them back
when it is re-admitted. Soft reset frees the request's blocks and sets its computed counter to 0;
its generated tokens stay in `all_token_ids`, so when it is admitted again
the whole sequence is prefilled (prefix-cache hits included) and decoding
continues where it stopped, with identical greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbrun.engine.cache.kv_cache import KVCacheManager
from cbrun.engine.cache.kv_store import KVStore, zeros
from cbrun.engine.request import Request


@dataclass
class PreemptionCounters:
    offloads: int = 0
    restores: int = 0
    soft_resets: int = 0


class SoftResetPreemptor:
    """Preempts by recomputation: no copies, costs prefill time on resume."""

    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        self.counters = PreemptionCounters()

    def preempt(self, requests: list[Request]) -> None:
        for request in requests:
            self.soft_reset(request)

    def soft_reset(self, request: Request) -> None:
        self.cache.free(request.key)
        request.restart()
        self.counters.soft_resets += 1

    def restore(self, request: Request, num_tokens: int) -> bool:
        raise RuntimeError("soft-reset requests are re-admitted as new, never restored")

    def discard(self, request: Request) -> None:
        self.cache.free(request.key)

    def release(self) -> None:
        """Give the swap pool's memory back (sleep); nothing to give without one."""

    def reallocate(self) -> None:
        """Bring the swap pool back after `release`."""


class CpuOffloadPreemptor(SoftResetPreemptor):
    """Preempts by copying KV pages to a preallocated CPU swap pool; falls back to soft reset.

    All requests preempted together that fit in the swap pool move in one
    gather-and-copy; they come back (restore) without recomputation.
    """

    def __init__(self, cache: KVCacheManager, store: KVStore, swap_blocks: int) -> None:
        super().__init__(cache)
        self.store = store
        self.swap: torch.Tensor | None = _zeros_like_pool(store, swap_blocks)  # [layers, 2, H_kv, swap_blocks, page, D]
        self._free_swap = list(range(swap_blocks - 1, -1, -1))
        self._swap_blocks = swap_blocks
        self._saved: dict[object, list[SavedGroup]] = {}

    def preempt(self, requests: list[Request]) -> None:
        moving: list[tuple[Request, list[SavedGroup]]] = []
        for request in requests:
            groups = self._plan(request)
            if groups is None:
                self.soft_reset(request)
            else:
                moving.append((request, groups))
        if not moving:
            return
        pool_ids = [b for _, groups in moving for g in groups for b in g.pool_blocks]
        swap_ids = [s for _, groups in moving for g in groups for s in g.swap_blocks]
        assert self.store.data is not None and self.swap is not None  # preemption runs only while awake
        self._copy(self.store.data, pool_ids, self.swap, swap_ids)
        for request, groups in moving:
            self.cache.free(request.key)
            self._saved[request.key] = groups
            request.mark_offloaded()
            self.counters.offloads += 1

    def _plan(self, request: Request) -> list[SavedGroup] | None:
        """Reserve swap blocks for every page the request holds, or None if the pool is full."""
        tables = self.cache.blocks_of(request.key)
        needed = sum(len(t) for t in tables.values())
        if needed == 0 or needed > len(self._free_swap):
            return None
        groups = []
        for name, blocks in tables.items():
            swap = [self._free_swap.pop() for _ in blocks]
            groups.append(SavedGroup(name, blocks, swap, self.cache.first_page(name, request.key)))
        return groups

    def restore(self, request: Request, num_tokens: int) -> bool:
        groups = self._saved[request.key]
        needed = sum(len(g.swap_blocks) for g in groups)
        if needed > self.cache.pool.num_free:
            return False
        for group in groups:
            blocks = self.cache.pool.allocate(len(group.swap_blocks))
            assert blocks is not None  # the pool has room for all groups (checked above)
            group.pool_blocks = blocks
            self.cache.allocators[group.name].adopt(request.key, group.pool_blocks, group.first_page)
        if not self.cache.allocate(request.key, num_tokens):
            self.cache.free(request.key)
            return False
        assert self.store.data is not None and self.swap is not None  # restores run only while awake
        self._copy(
            self.swap,
            [s for g in groups for s in g.swap_blocks],
            self.store.data,
            [b for g in groups for b in g.pool_blocks],
        )
        self.discard(request)
        self.cache.commit(request.key, request.all_token_ids, request.num_computed_tokens)
        self.counters.restores += 1
        return True

    def discard(self, request: Request) -> None:
        for group in self._saved.pop(request.key, []):
            self._free_swap.extend(group.swap_blocks)

    def release(self) -> None:
        """Drop the swap pool and whatever it holds (KV computed with the weights of the time)."""
        if self._saved:
            raise RuntimeError("offloaded requests still hold swapped-out KV pages")
        self.swap = None  # `_swap_blocks` keeps its size for `reallocate`

    def reallocate(self) -> None:
        if self.swap is None:
            self.swap = _zeros_like_pool(self.store, self._swap_blocks)

    @staticmethod
    def _copy(source: torch.Tensor, source_ids: list[int], target: torch.Tensor, target_ids: list[int]) -> None:
        """target[..., target_ids, :, :] = source[..., source_ids, :, :] in one gather and one scatter."""
        src = torch.tensor(source_ids, dtype=torch.long, device=source.device)
        dst = torch.tensor(target_ids, dtype=torch.long, device=target.device)
        pages = source.index_select(3, src)  # [layers, 2, H_kv, n, page, D]
        target.index_copy_(3, dst, pages.to(target.device, non_blocking=True))


@dataclass
class SavedGroup:
    """Where one attention group's pages of an offloaded request went."""

    name: str
    pool_blocks: list[int]
    swap_blocks: list[int]
    first_page: int


def _zeros_like_pool(store: KVStore, blocks: int) -> torch.Tensor:
    """A CPU pool shaped like the store with `blocks` pages.

    Pinned for GPU copies, else lazily zeroed (kv_store.zeros).
    """
    assert store.data is not None  # the swap pool is made while the store is allocated
    shape = list(store.data.shape)
    shape[3] = blocks
    if store.device.type == "cuda":
        return torch.zeros(shape, dtype=store.data.dtype, pin_memory=True)
    return zeros(tuple(shape), store.data.dtype, torch.device("cpu"))


def make_preemptor(cache: KVCacheManager, store: KVStore, offload_gib: float) -> SoftResetPreemptor:
    """Soft reset alone, or CPU offload with soft reset as the fallback."""
    per_block = store.shape.bytes_per_block(store.page_size)
    swap_blocks = int(offload_gib * 2**30) // per_block
    if swap_blocks <= 0:
        return SoftResetPreemptor(cache)
    return CpuOffloadPreemptor(cache, store, swap_blocks)
