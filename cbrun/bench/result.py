"""What one engine's timed pass measured, and the figures derived from it."""

from __future__ import annotations

from dataclasses import dataclass, field


class PeerUnavailable(Exception):
    """The peer cannot run here (not installed, unsupported); the message says why."""


@dataclass
class PeerResult:
    """One engine's timed pass over the workload.

    output_counts[i] is the number of tokens generated for prompt i, summed
    over its n samples, so engines can be compared request by request.
    ttfts holds time-to-first-token in seconds per (prompt, sample) where the
    engine exposes it; empty when it does not.
    """

    engine: str
    status: str = "ok"  # "ok" | "unavailable" | "failed"
    dtype: str | None = None  # the dtype the engine computed in (each engine runs its own default unless told)
    reason: str | None = None
    wall_s: float = 0.0
    num_requests: int = 0
    num_input_tokens: int = 0
    output_counts: list[int] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    peak_rss_bytes: int | None = None  # while the engine ran: this process's, or vLLM's processes' summed
    details: dict = field(default_factory=dict)  # engine-specific figures (cbrun stats, configs used)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_counts)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def input_tokens_per_s(self) -> float:
        return self.num_input_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return self.input_tokens_per_s + self.output_tokens_per_s

    def ttft_percentile(self, q: float) -> float | None:
        return percentile(self.ttfts, q)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def count_check(result: PeerResult, expected: list[int] | None, reference: PeerResult | None) -> str | None:
    """A message when `result`'s output counts differ from what is required, else None.

    With ignore-EOS every engine must produce exactly `expected` (the requested
    lengths). Without it, counts legitimately differ where an engine stops at
    EOS, so they are compared with the reference engine only for information.
    """
    if not result.ok:
        return None
    counts = result.output_counts
    if expected is not None:
        target, what = expected, "the requested lengths"
    elif reference is not None and reference.ok and reference is not result:
        target, what = reference.output_counts, f"{reference.engine} (EOS allowed, so this can differ)"
    else:
        return None
    if counts == target:
        return None
    diffs = [i for i, (a, b) in enumerate(zip(counts, target)) if a != b]
    first = f"; first at prompt {diffs[0]}: {counts[diffs[0]]} vs {target[diffs[0]]}" if diffs else ""
    return (
        f"{result.engine}: {sum(counts)} output tokens in {len(counts)} prompts, "
        f"{sum(target)} in {len(target)} from {what}; {len(diffs)} prompts differ{first}"
    )
