"""What happens to a preempted request: soft reset (recompute later).

Soft reset frees the request's blocks and sets its computed counter to 0;
its generated tokens stay in `all_token_ids`, so when it is admitted again
the whole sequence is prefilled (prefix-cache hits included) and decoding
continues where it stopped, with identical greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbrun.engine.kv_cache import KVCacheManager
from cbrun.engine.request import Request, RequestStatus


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

    def preempt(self, request: Request) -> None:
        self.cache.free(request.key)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PENDING
        self.counters.soft_resets += 1

    def restore(self, request: Request, num_tokens: int) -> bool:
        raise RuntimeError("soft-reset requests are re-admitted as new, never restored")

    def discard(self, request: Request) -> None:
        self.cache.free(request.key)
