"""The dashboard: plain progress lines off a terminal, the live view, the summary table."""

from __future__ import annotations

import io
import time

from fake_engine import FakeEngine
from rich.console import Console

from cbrun.dashboard import Dashboard, EngineProgress, format_duration
from cbrun.data.job import JobProgress
from cbrun.engine.stats import StatsSnapshot


def progress(done=4, total=10, failed=1, skipped=0, age=8.0):
    return JobProgress(
        rows_total=total,
        rows_done=done,
        rows_failed=failed,
        rows_skipped=skipped,
        samples_written=done,
        prompt_tokens=400,
        completion_tokens=120,
        started=time.perf_counter() - age,
    )


def render(renderable) -> str:
    console = Console(file=io.StringIO(), width=140, force_terminal=True, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_off_a_terminal_it_prints_plain_progress_lines_every_interval():
    stream = io.StringIO()
    dashboard = Dashboard(FakeEngine().stats, progress(), stream=stream, interval=0.05)
    assert not dashboard.live  # StringIO is not a terminal
    with dashboard:
        time.sleep(0.4)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3
    line = lines[-1]
    for part in (
        "rows 4/10 (40.0%)",
        "eta 00:1",
        "tok/s",
        "req/s",
        "pending",
        "prefilling 0",
        "decoding 0",
        "kv 30% (used 30 cached 10 free 60)",
        "prefix hit 25%",
        "offloads 0 soft resets 0",
        "errors 1",
    ):
        assert part in line, (part, line)
    assert "\x1b[" not in stream.getvalue()  # no terminal escapes in logs


def test_unknown_total_shows_rows_without_percent_or_eta():
    dashboard = Dashboard(FakeEngine().stats, progress(total=None), stream=io.StringIO())
    line = dashboard.progress_line()
    assert "rows 4 eta --:--" in line


def test_live_view_shows_every_field():
    text = render(Dashboard(FakeEngine().stats, progress(), stream=io.StringIO(), title="gen").renderable())
    for part in (
        "gen",
        "4/10 rows",
        "eta 00:1",
        "throughput",
        "tok/s",
        "req/s",
        "pending",
        "prefilling",
        "decoding",
        "kv cache",
        "30% used 30 cached 10 free 60 / 100",
        "hit rate 25.0%",
        "offloads 0",
        "soft resets 0",
        "errors",
    ):
        assert part in text, (part, text)


def test_live_mode_runs_on_a_terminal_stream():
    stream = io.StringIO()
    dashboard = Dashboard(FakeEngine().stats, progress(), stream=stream, live=True)
    with dashboard:
        time.sleep(0.3)
    assert "kv cache" in stream.getvalue()


def test_final_summary_table_reports_rows_tokens_and_engine_figures():
    stats = StatsSnapshot(
        steps=12,
        blocks_total=100,
        peak_blocks_used=40,
        prompt_tokens=400,
        prefix_hit_tokens=100,
        decode_steps=4,
        decode_batch_tokens=10,
        offloads=2,
        soft_resets=1,
    )
    p = progress(done=10, total=10, failed=2, skipped=3)
    p.finished = p.started + 4.0
    text = render(Dashboard(lambda: stats, p, stream=io.StringIO()).summary_table([("output", "out.jsonl")]))
    for part in (
        "rows",
        "10 of 10",
        "succeeded",
        "8",
        "failed",
        "already in output (resume)",
        "3",
        "prompt tokens",
        "400",
        "completion tokens",
        "120",
        "wall time",
        "00:04",
        "output tokens/s",
        "30.0",
        "engine steps",
        "12",
        "mean decode batch",
        "2.5",
        "peak kv occupancy",
        "40% of 100 blocks",
        "prefix-cache hit rate",
        "25.0%",
        "offloads / soft resets",
        "2 / 1",
        "out.jsonl",
    ):
        assert part in text, (part, text)


def test_a_failing_stats_call_keeps_the_last_snapshot():
    calls = []

    def stats():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("engine gone")
        return StatsSnapshot(steps=7)

    dashboard = Dashboard(stats, progress(), stream=io.StringIO())
    assert dashboard.stats().steps == 7
    assert dashboard.stats().steps == 7


def test_engine_progress_counts_requests_from_engine_counters():
    class Engine:
        snapshot = StatsSnapshot(finished=5, failed=1, pending=2)

        def stats(self):
            return self.snapshot

    engine = Engine()
    p = EngineProgress(engine)
    engine.snapshot = StatsSnapshot(finished=8, failed=2, pending=1, decoding=3)
    assert (p.rows_done, p.rows_failed, p.rows_total) == (4, 1, 8)


def test_format_duration():
    assert format_duration(None) == "--:--"
    assert format_duration(75) == "01:15"
    assert format_duration(3725) == "1:02:05"
