"""One scheduling loop: which requests get how many tokens in the next forward.

Three limits bound a step: the token budget (`max_batch_tokens`), the cache
(blocks that can be allocated) and `max_requests_per_batch`. Each request
closes the gap between `num_computed_tokens` and its token count; a prompt
longer than the remaining budget is simply given part of it (chunked prefill).
FIFO and prefill-first differ only in the order running requests are visited.

When a running request cannot get its next block, the newest requests not
yet scheduled in this step are preempted (offloaded or soft-reset by the
`Preemptor`) until it can; the last active request is never preempted for
another, and a request that cannot fit the whole cache alone fails.
Plain Python, no torch.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Protocol

from cbrun.engine.cache.kv_cache import KVCacheManager
from cbrun.engine.config import EngineConfig
from cbrun.engine.request import Request, RequestStatus


class Preemptor(Protocol):
    """How a preempted request gives back its blocks, and how it comes back."""

    def preempt(self, requests: list[Request]) -> None:
        """Free the requests' blocks (offloading their KV, or resetting them for recompute)."""
        ...

    def restore(self, request: Request, num_tokens: int) -> bool:
        """Give an offloaded request slots for `num_tokens` tokens and its KV back; False if no room."""
        ...

    def discard(self, request: Request) -> None:
        """Forget whatever the preemptor keeps for a request that leaves for good (its offloaded KV)."""
        ...


class Reservation(enum.Enum):
    """What became of a running request's claim on slots for its next tokens this step."""

    RESERVED = "reserved"  # the slots are allocated: it runs this step
    PREEMPTED = "preempted"  # it gave way itself (newer requests had nothing left to give)
    FAILED = "failed"  # alone in the engine and still too large for the whole cache: it ends


@dataclass
class ScheduledBatch:
    """The work of one forward: (request, new tokens) pairs, decodes first."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """Owns the waiting and running queues and the cache bookkeeping of requests."""

    def __init__(self, config: EngineConfig, cache: KVCacheManager, preemptor: Preemptor) -> None:
        self.config = config
        self.cache = cache
        self.preemptor = preemptor
        self.waiting: list[Request] = []  # sorted by arrival order
        self.running: list[Request] = []  # arrival order
        self.prefix_hit_tokens = 0  # prompt tokens reused from the prefix cache at first admission

    # -- queue management -----------------------------------------------
    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.arrival_order)

    def remove(self, request: Request) -> None:
        """Take a finished, failed or cancelled request out and free its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request.key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def recompute_all(self) -> None:
        """Every live request gives back its blocks (and offloaded K/V) and waits to be computed again from
        token 0, its tokens kept: a soft reset of all, for K/V that the weights it came from no longer give."""
        for request in self.running:
            self.add(request)
        self.running = []
        for request in self.waiting:
            self.preemptor.discard(request)
            self.cache.free(request.key)
            request.restart()

    # -- the step ---------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work under the token, request and cache budgets."""
        batch = ScheduledBatch()
        budget = self.config.max_batch_tokens
        slots = self.config.max_requests_per_batch
        scheduled: set[int] = set()
        preempted = False
        for request in self._running_order():
            if budget <= 0 or slots <= 0:
                break
            if request not in self.running:
                continue  # preempted earlier in this loop
            count = min(request.num_uncomputed, budget)
            outcome = self._reserve(request, count, scheduled, batch)
            preempted |= outcome is not Reservation.RESERVED
            if outcome is Reservation.RESERVED:
                batch.items.append((request, count))
                scheduled.add(id(request))
                budget -= count
                slots -= 1
        if not preempted:
            self._admit_waiting(batch, budget, slots)
        batch.items.sort(key=lambda item: item[1] != 1)  # single-query sequences first
        return batch

    def _running_order(self) -> list[Request]:
        """The ordering hook: FIFO visits decodes first, prefill-first the reverse."""
        decoding = [r for r in self.running if not r.is_prefilling]
        prefilling = [r for r in self.running if r.is_prefilling]
        if self.config.scheduler == "prefill-first":
            return prefilling + decoding
        return decoding + prefilling

    def _reserve(self, request: Request, count: int, scheduled: set[int], batch: ScheduledBatch) -> Reservation:
        """Allocate slots for `count` more tokens, preempting newer requests if needed."""
        target = request.num_computed_tokens + count
        while not self.cache.allocate(request.key, target):
            shortfall = self.cache.blocks_needed(request.key, target) - self.cache.pool.num_free
            victims = self._victims(shortfall, exclude=scheduled | {id(request)})
            if victims:
                self._preempt(victims)
                continue
            if len(self.running) == 1 and not batch.items:
                self.running.remove(request)
                self.cache.free(request.key)
                batch.failed.append((request, self._too_large_message(request)))
                return Reservation.FAILED
            self._preempt([request])
            return Reservation.PREEMPTED
        return Reservation.RESERVED

    def _victims(self, shortfall: int, exclude: set[int]) -> list[Request]:
        """The fewest newest running requests (not protected this step) whose blocks cover the shortfall."""
        victims, freed = [], 0
        for request in reversed(self.running):
            if id(request) in exclude:
                continue
            victims.append(request)
            freed += self.cache.exclusive_blocks(request.key)
            if freed >= shortfall:
                break
        return victims

    def _preempt(self, requests: list[Request]) -> None:
        for request in requests:
            self.running.remove(request)
        self.preemptor.preempt(requests)
        for request in requests:
            self.add(request)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, slots: int) -> None:
        """Start waiting requests in arrival order while budgets and the cache allow.

        A request whose next uncached block is being computed by another
        request in this very step waits one step, then hits the cache
        instead of computing the same prefix again.
        """
        pool = self.cache.pool
        margin = self.config.safety_margin
        assert margin is not None  # EngineConfig.__post_init__ resolves None to the scheduler's default
        inflight = self._inflight_hashes(batch)
        index = 0
        while index < len(self.waiting) and budget > 0 and slots > 0:
            request = self.waiting[index]
            if self.running and pool.num_free < margin * pool.num_blocks:
                return  # keep the margin for running decodes
            if request.status is not RequestStatus.OFFLOADED and request.num_computed_tokens == 0:
                self._attach_prefix(request)
            count = min(request.num_uncomputed, budget)
            produces = self.cache.hashes_between(
                request.key,
                request.all_token_ids,
                request.num_computed_tokens,
                request.num_tokens - 1,
                request.cache_salt,
            )
            if produces and produces[0] in inflight:
                self.cache.free(request.key)
                request.num_computed_tokens = 0
                index += 1
                continue
            if not self._allocate_for_admission(request, request.num_computed_tokens + count):
                if not self.running and not batch.items:
                    self.waiting.pop(index)
                    self.preemptor.discard(request)
                    batch.failed.append((request, self._too_large_message(request)))
                    continue
                return
            self.waiting.pop(index)
            inflight.update(produces[: count // self.cache.page_size])
            request.mark_running()
            self.running.append(request)
            batch.items.append((request, count))
            budget -= count
            slots -= 1

    def _inflight_hashes(self, batch: ScheduledBatch) -> set[bytes]:
        """Hashes of the full blocks that this step's prefill chunks will produce."""
        hashes: set[bytes] = set()
        for request, count in batch.items:
            if count > 1:
                start = request.num_computed_tokens
                hashes.update(
                    self.cache.hashes_between(
                        request.key, request.all_token_ids, start, start + count, request.cache_salt
                    )
                )
        return hashes

    def _allocate_for_admission(self, request: Request, num_tokens: int) -> bool:
        """Allocate (or restore from offload) all-or-nothing; on failure hold no blocks."""
        if request.status is RequestStatus.OFFLOADED:
            return self.preemptor.restore(request, num_tokens)
        if self.cache.allocate(request.key, num_tokens):
            return True
        self.cache.free(request.key)
        request.num_computed_tokens = 0
        return False

    def _attach_prefix(self, request: Request) -> None:
        hit = self.cache.match_prefix(request.key, request.prefix_match_ids, request.cache_salt)
        request.num_computed_tokens = hit
        if hit and request.num_cached_tokens == 0 and request.is_fresh:
            request.num_cached_tokens = hit
            self.prefix_hit_tokens += hit

    def _too_large_message(self, request: Request) -> str:
        pool = self.cache.pool
        return (
            f"request needs {self.cache.max_blocks_for(request.num_tokens)} KV-cache blocks "
            f"({request.num_tokens} tokens at page size {self.cache.page_size}) but the whole "
            f"cache has {pool.num_blocks}; raise --num-blocks or lower max tokens"
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if a request is queued twice or holds foreign blocks."""
        keys = [r.key for r in self.running] + [r.key for r in self.waiting]
        assert len(keys) == len(set(keys)), "a request is queued twice"
        owners: dict[tuple[str, int], object] = {}  # (allocator, block) -> request key
        for name, allocator in self.cache.allocators.items():
            for key, table in allocator.tables.items():
                for block in table:
                    if not self.cache.sharing:
                        assert (name, block) not in owners, f"block {block} owned twice"
                    owners[(name, block)] = key
        self.cache.pool.check_invariants()
