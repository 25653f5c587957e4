"""What the engine reports: `StatsSnapshot`, the counters a dashboard or a benchmark polls."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cbrun.engine.request import RequestStatus

if TYPE_CHECKING:
    from cbrun.engine.cache.block_pool import BlockPool
    from cbrun.engine.cache.offload import PreemptionCounters
    from cbrun.engine.scheduler import Scheduler


@dataclass
class StatsSnapshot:
    """A point-in-time view of the engine, polled by dashboards and benchmarks."""

    steps: int = 0
    pending: int = 0
    prefilling: int = 0
    decoding: int = 0
    offloaded: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_cached: int = 0
    blocks_free: int = 0
    peak_blocks_used: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    scored_tokens: int = 0  # positions whose logprob a scoring request kept
    offloads: int = 0
    restores: int = 0
    soft_resets: int = 0
    decode_batch_tokens: int = 0
    decode_steps: int = 0
    elapsed_s: float = 0.0
    busy_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def input_tokens_per_s(self) -> float:
        return self.computed_prompt_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def kv_occupancy(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_batch_tokens / self.decode_steps if self.decode_steps else 0.0


def snapshot(
    counters: StatsSnapshot, scheduler: Scheduler, pool: BlockPool, preemptions: PreemptionCounters, started: float
) -> StatsSnapshot:
    """A copy of the core's running counters with the queues' and the cache's occupancy filled in."""
    snap = StatsSnapshot(**{k: v for k, v in vars(counters).items() if k != "extra"})
    snap.pending = sum(1 for r in scheduler.waiting if r.status is not RequestStatus.OFFLOADED)
    snap.offloaded = sum(1 for r in scheduler.waiting if r.status is RequestStatus.OFFLOADED)
    snap.prefilling = sum(1 for r in scheduler.running if r.is_prefilling)
    snap.decoding = len(scheduler.running) - snap.prefilling
    snap.blocks_used = pool.num_used
    snap.blocks_cached = pool.num_cached
    snap.blocks_free = pool.num_free - pool.num_cached
    snap.prefix_hit_tokens = scheduler.prefix_hit_tokens
    snap.offloads, snap.restores, snap.soft_resets = preemptions.offloads, preemptions.restores, preemptions.soft_resets
    snap.elapsed_s = time.perf_counter() - started
    return snap
