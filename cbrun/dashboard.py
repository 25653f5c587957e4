"""Progress and engine statistics on stderr, for `cbrun generate` and `cbrun bench`.

When the stream is a terminal: a rich Live view (progress bar with ETA,
throughput, request states, KV-cache occupancy bar, prefix-cache hit rate,
offloads and soft resets, errors). Otherwise: one plain progress line every
`interval` seconds, so logs of batch jobs stay readable. Either way the caller
prints a summary table at the end.

The dashboard only reads: it polls `stats()` (an engine's `StatsSnapshot`) and
a progress object with `rows_total`, `rows_done`, `rows_failed` (and optionally
`rows_skipped`, `started`), such as `cbrun.data.job.JobProgress`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console, Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from cbrun.engine.stats import StatsSnapshot

if TYPE_CHECKING:
    from rich.live import Live

    from cbrun.engine.engine import Engine

RATE_WINDOW_S = 10.0  # throughput is averaged over the last seconds
KV_BAR_WIDTH = 24


class Rates:
    """Recent rates from counter samples: tokens/s and requests/s over the last RATE_WINDOW_S."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int, int, int]] = deque()

    def update(self, now: float, stats: StatsSnapshot) -> tuple[float, float, float]:
        """(input tokens/s, output tokens/s, requests/s)."""
        done = stats.finished + stats.failed + stats.cancelled
        self._samples.append((now, stats.computed_prompt_tokens, stats.generated_tokens, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, p0, g0, d0 = self._samples[0]
        span = now - t0
        if span <= 0:
            return stats.input_tokens_per_s, stats.output_tokens_per_s, 0.0
        return (stats.computed_prompt_tokens - p0) / span, (stats.generated_tokens - g0) / span, (done - d0) / span


class Dashboard:
    """Live view (terminal) or periodic progress lines (pipe, file) on a stream.

    stats: returns the engine's current StatsSnapshot.
    progress: the job's counters (read only).
    live: force the rich view on (True) or off (False); None picks by stream.isatty().
    interval: seconds between plain progress lines.
    """

    def __init__(
        self,
        stats: Callable[[], StatsSnapshot],
        progress: Any,
        *,
        stream: TextIO | None = None,
        live: bool | None = None,
        interval: float = 5.0,
        title: str = "cbrun",
    ):
        self._stats_fn = stats
        self.progress = progress
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.interval = interval
        self.title = title
        self.notes: list[tuple[str, str]] = []  # (name, value) rows the summary shows, e.g. the linear kernels
        self.console = Console(file=self.stream, force_terminal=self.live or None)
        self._rates = Rates()
        self._last = StatsSnapshot()
        self._live: Live | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    # --- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.live:
            from rich.live import Live

            self._live = Live(
                get_renderable=self.renderable,
                console=self.console,
                refresh_per_second=4,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
        else:
            self._thread = threading.Thread(target=self._print_lines, name="cbrun-dashboard", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def note(self, message: str) -> None:
        """A one-off message (e.g. "stopping after in-flight requests") above the live view."""
        self.console.print(message, highlight=False)

    def _print_lines(self) -> None:
        while not self._stopped.wait(self.interval):
            print(self.progress_line(), file=self.stream, flush=True)

    # --- what is shown -----------------------------------------------------------------

    def stats(self) -> StatsSnapshot:
        """The engine's snapshot; the last one if the engine cannot answer (it is stopping)."""
        with contextlib.suppress(Exception):  # a stopped engine must not kill the dashboard
            self._last = self._stats_fn()
        return self._last

    def _eta(self) -> float | None:
        p = self.progress
        total = p.rows_total
        worked = p.rows_done - getattr(p, "rows_skipped", 0)
        elapsed = time.perf_counter() - getattr(p, "started", time.perf_counter())
        if not total or worked <= 0 or elapsed <= 0:
            return None
        return max(total - p.rows_done, 0) * elapsed / worked

    def progress_line(self) -> str:
        """One line for logs: rows, ETA, throughput, states, KV cache, prefix hits, errors."""
        s = self.stats()
        tin, tout, rps = self._rates.update(time.perf_counter(), s)
        p = self.progress
        total = f"/{p.rows_total}" if p.rows_total is not None else ""
        percent = f" ({100 * p.rows_done / p.rows_total:.1f}%)" if p.rows_total else ""
        return (
            f"[{self.title}] rows {p.rows_done}{total}{percent} eta {format_duration(self._eta())} | "
            f"in {tin:.0f} tok/s out {tout:.0f} tok/s {rps:.1f} req/s | "
            f"pending {s.pending} prefilling {s.prefilling} decoding {s.decoding} | "
            f"kv {s.kv_occupancy:.0%} (used {s.blocks_used} cached {s.blocks_cached} free {s.blocks_free}) | "
            f"prefix hit {s.prefix_hit_rate:.0%} | offloads {s.offloads} soft resets {s.soft_resets} | "
            f"errors {p.rows_failed}"
        )

    def renderable(self):
        """The live view: a progress bar and a grid of engine figures."""
        s = self.stats()
        tin, tout, rps = self._rates.update(time.perf_counter(), s)
        p = self.progress
        total = p.rows_total
        head = Table.grid(padding=(0, 1))
        head.add_row(
            Text(self.title, style="bold"),
            ProgressBar(total=total or None, completed=p.rows_done, width=40),
            Text(f"{p.rows_done}/{total if total is not None else '?'} rows"),
            Text(f"eta {format_duration(self._eta())}", style="cyan"),
        )
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim")
        grid.add_column()
        grid.add_row("throughput", f"in {tin:,.0f} tok/s   out {tout:,.0f} tok/s   {rps:,.1f} req/s")
        grid.add_row(
            "requests",
            f"pending {s.pending}   prefilling {s.prefilling}   decoding {s.decoding}"
            + (f"   offloaded {s.offloaded}" if s.offloaded else ""),
        )
        grid.add_row("kv cache", kv_bar(s))
        grid.add_row("prefix cache", f"hit rate {s.prefix_hit_rate:.1%} ({s.prefix_hit_tokens:,} tokens)")
        grid.add_row("preemption", f"offloads {s.offloads}   restores {s.restores}   soft resets {s.soft_resets}")
        errors = Text(str(p.rows_failed), style="red" if p.rows_failed else "")
        grid.add_row("errors", errors)
        return Group(head, grid)

    def summary_table(self, extra: list[tuple[str, str]] | None = None) -> Table:
        """The end-of-job table: rows, tokens, throughput and the engine's figures."""
        s = self.stats()
        p = self.progress
        elapsed = getattr(p, "elapsed_s", None) or s.elapsed_s
        table = Table(title=f"{self.title} summary", show_header=False, title_justify="left")
        table.add_column(style="dim")
        table.add_column(justify="right")
        ok = p.rows_done - p.rows_failed
        table.add_row("rows", f"{p.rows_done:,}" + (f" of {p.rows_total:,}" if p.rows_total is not None else ""))
        table.add_row("succeeded", f"{ok:,}")
        table.add_row("failed", Text(f"{p.rows_failed:,}", style="red" if p.rows_failed else ""))
        if getattr(p, "rows_skipped", 0):
            table.add_row("already in output (resume)", f"{p.rows_skipped:,}")
        if hasattr(p, "samples_written"):
            table.add_row("output rows written", f"{p.samples_written:,}")
        prompt_tokens = getattr(p, "prompt_tokens", s.prompt_tokens)
        completion_tokens = getattr(p, "completion_tokens", s.generated_tokens)
        table.add_row("prompt tokens", f"{prompt_tokens:,}")
        table.add_row("completion tokens", f"{completion_tokens:,}")
        table.add_row("wall time", format_duration(elapsed))
        if elapsed > 0:
            table.add_row("output tokens/s", f"{completion_tokens / elapsed:,.1f}")
            table.add_row("total tokens/s", f"{(prompt_tokens + completion_tokens) / elapsed:,.1f}")
            table.add_row("rows/s", f"{(p.rows_done - getattr(p, 'rows_skipped', 0)) / elapsed:,.2f}")
        table.add_row("engine steps", f"{s.steps:,}")
        table.add_row("mean decode batch", f"{s.mean_decode_batch:.1f}")
        peak = s.peak_blocks_used / s.blocks_total if s.blocks_total else 0.0
        table.add_row("peak kv occupancy", f"{peak:.0%} of {s.blocks_total:,} blocks")
        table.add_row("prefix-cache hit rate", f"{s.prefix_hit_rate:.1%}")
        table.add_row("offloads / soft resets", f"{s.offloads} / {s.soft_resets}")
        for name, value in [*self.notes, *(extra or [])]:
            table.add_row(name, value)
        return table

    def print_summary(self, extra: list[tuple[str, str]] | None = None) -> None:
        self.console.print(self.summary_table(extra))


def kv_bar(s: StatsSnapshot, width: int = KV_BAR_WIDTH) -> Text:
    """used (red) | cached (yellow) | free (green) blocks as one bar, with the counts."""
    total = s.blocks_total or 1
    used = round(width * s.blocks_used / total)
    cached = min(round(width * s.blocks_cached / total), width - used)
    bar = Text()
    bar.append("█" * used, style="red")
    bar.append("█" * cached, style="yellow")
    bar.append("█" * (width - used - cached), style="green")
    bar.append(
        f" {s.kv_occupancy:.0%} used {s.blocks_used} cached {s.blocks_cached} free {s.blocks_free} / {s.blocks_total}"
    )
    return bar


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class EngineProgress:
    """Progress read from an engine's own counters, for work submitted up front (benchmarks).

    Rows are requests (samples) finished since this object was made; the total
    is those plus the requests still live in the engine (never decreasing).
    """

    def __init__(self, engine):
        self._engine = engine
        first = engine.stats()
        self._base_done = _finished(first)
        self._base_failed = first.failed
        self._total = 0
        self.started = time.perf_counter()

    @property
    def rows_done(self) -> int:
        return _finished(self._engine.stats()) - self._base_done

    @property
    def rows_failed(self) -> int:
        return self._engine.stats().failed - self._base_failed

    @property
    def rows_total(self) -> int:
        s = self._engine.stats()
        live = s.pending + s.prefilling + s.decoding + s.offloaded
        self._total = max(self._total, _finished(s) - self._base_done + live)
        return self._total

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started


def _finished(s: StatsSnapshot) -> int:
    return s.finished + s.failed + s.cancelled


def bench_dashboard(engine: Engine, title: str = "cbrun bench") -> Dashboard:
    """The generate dashboard over an engine whose requests were all submitted (a context manager)."""
    return Dashboard(engine.stats, EngineProgress(engine), title=title)
