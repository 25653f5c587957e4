"""`cbrun generate --ray`: the same reader, options and output columns, on K Ray actors.

    driver: cbrun reader -> row blocks (row number, record as JSON, reader error)
        -> ray.data.from_arrow -> map_batches(CbrunGenerator, K actors)
        -> iter_batches (completion order) -> one Parquet part file per block, or JSON lines

The driver reads the whole input into Ray's object store first (prompts only,
a few hundred bytes a row), so every row's number is known and bad lines
become the same error rows as without Ray. Results come back a block at a time
as actors finish them, and each block is written at once. A block whose actor
dies is run again by Ray on a restarted actor (Ray Data's defaults restart and
retry without limit) and only the successful attempt reaches the driver, so no
row is lost or written twice.

On a small machine an actor that reserves a whole CPU per engine can leave Ray
nothing for its own tasks and hang; by default a local cluster reserves at
most half the cores for engines, in fractions, and each engine's thread count
is set explicitly (`--threads-per-replica`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cbrun.data.constraints import row_constraint
from cbrun.data.reader import RawRow
from cbrun.scale.ray_data import ERROR, LINE, RECORD, ROW, CbrunGenerator

BLOCKS_PER_REPLICA = 4  # small enough blocks that every replica stays busy to the end


class RayJobError(Exception):
    """Ray is missing, cannot start, or the job failed; one line."""


@dataclass
class RayProgress:
    """Counters of a Ray job (input rows), read by the progress reporter and the summary."""

    rows_total: int | None = None
    rows_done: int = 0
    rows_failed: int = 0
    samples_written: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    replicas: int = 0
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def add(self, table) -> None:
        """Count one result block: rows are distinct ids (all samples of a row share a block)."""
        rows = table.select(["id", "finish_reason", "num_prompt_tokens", "num_completion_tokens", "sample"]).to_pylist()
        self.rows_done += len({r["id"] for r in rows})
        self.rows_failed += len({r["id"] for r in rows if r["finish_reason"] == "error"})
        self.samples_written += len(rows)
        self.prompt_tokens += sum(r["num_prompt_tokens"] for r in rows if r["sample"] == 0)
        self.completion_tokens += sum(r["num_completion_tokens"] for r in rows)


def raw_blocks(rows: Iterable[RawRow], block_rows: int) -> Iterator:
    """pyarrow Tables of `block_rows` input rows each, in the columns `CbrunGenerator` reads back."""
    import pyarrow as pa

    schema = pa.schema([(ROW, pa.int64()), (RECORD, pa.string()), (ERROR, pa.string()), (LINE, pa.int64())])
    chunk: list[RawRow] = []

    def table():
        return pa.table(
            [
                [r.index for r in chunk],
                [None if r.record is None else json.dumps(r.record, ensure_ascii=False, default=str) for r in chunk],
                [r.error for r in chunk],
                [r.line for r in chunk],
            ],
            schema=schema,
        )

    for raw in rows:
        chunk.append(raw)
        if len(chunk) >= block_rows:
            yield table()
            chunk = []
    if chunk:
        yield table()


def rows_carry_constraints(rows: Iterable[RawRow]) -> bool:
    """Whether any row has its own structured-output constraint (a valid one or not).

    The driver holds every row before the job starts, and Ray blocks must share one schema, so
    this decides the `structured` column for the whole job (`CbrunGenerator(structured=...)`).
    """
    return any(raw.record is not None and row_constraint(raw.record) is not None for raw in rows)


def block_size(total: int, replicas: int, window: int) -> int:
    """Rows per block: BLOCKS_PER_REPLICA blocks per replica, at most `window` rows (memory, retry cost)."""
    return max(1, min(window, math.ceil(total / (replicas * BLOCKS_PER_REPLICA))))


def default_cpus(threads: int, replicas: int, local: bool) -> float:
    """CPUs each actor reserves: its threads on a cluster; on this machine, at most half the cores in all."""
    if not local:
        return float(threads)
    cores = os.cpu_count() or 1
    return max(0.05, min(float(threads), cores / 2 / replicas))


def start_ray(address: str | None, threads: int, quiet: bool) -> None:
    """Join `address` or start a local cluster whose workers import this same cbrun."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise RayJobError("--ray needs Ray Data: pip install 'cbrun[ray]'") from None
    import logging

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a batch tool does not phone home by default
    env_vars = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if address is None:  # local workers: the cbrun the driver runs, even from a source checkout
        source_root = str(Path(__file__).resolve().parents[2])
        env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)
    try:
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=not quiet,
            logging_level=logging.ERROR if quiet else logging.WARNING,
            runtime_env={"env_vars": env_vars},
            ignore_reinit_error=True,
        )
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError ... from ray.init
        raise RayJobError(
            f"cannot start or join Ray{f' at {address}' if address else ''}: {_first_line(exc)}"
        ) from None
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # our own progress line says rows done and tokens/s
    context.enable_operator_progress_bars = False
    if quiet:
        logging.getLogger("ray.data").setLevel(logging.ERROR)


def run_ray_job(
    rows: Sequence[RawRow],
    write_block,
    progress: RayProgress,
    *,
    generator: dict,
    replicas: int,
    threads: int,
    cpus_per_replica: float,
    window: int,
    udf: type = CbrunGenerator,
) -> None:
    """Run every row (the whole input, read by the caller) through `replicas` actors of `udf` (CbrunGenerator
    or a subclass of it, which gets `generator` as keyword arguments); `write_block(table)` each result block
    as it arrives."""
    import ray

    progress.rows_total, progress.replicas = len(rows), replicas
    if not rows:
        return
    size = block_size(len(rows), replicas, window)
    ds = ray.data.from_arrow(list(raw_blocks(rows, size)))  # one block per batch: the unit of retry
    results = ds.map_batches(
        udf,
        fn_constructor_kwargs={**generator, "threads": threads},
        batch_format="pyarrow",
        batch_size=size,
        concurrency=replicas,
        num_cpus=cpus_per_replica,
    )  # Ray Data restarts dead actors
    try:
        for table in results.iter_batches(batch_format="pyarrow", batch_size=None):
            if table.num_rows:
                write_block(table)
                progress.add(table)
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:  # RayTaskError, RayActorError, ...: the job as a whole failed
        raise RayJobError(f"the Ray job failed: {_first_line(exc)}") from None
    finally:
        progress.finished = time.perf_counter()


class ProgressLines:
    """Rows done and tokens/s of the whole job on stderr, every `interval` seconds (a context manager)."""

    def __init__(self, progress: RayProgress, interval: float = 5.0, stream=None):
        self.progress = progress
        self.interval = interval
        self.stream = stream or sys.stderr
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cbrun-ray-progress", daemon=True)
        self._last = (time.perf_counter(), 0)

    def __enter__(self) -> ProgressLines:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._thread.join(timeout=2)

    def line(self) -> str:
        p = self.progress
        now = time.perf_counter()
        then, tokens = self._last
        rate = (p.completion_tokens - tokens) / (now - then) if now > then else 0.0
        self._last = (now, p.completion_tokens)
        total = f"/{p.rows_total}" if p.rows_total else ""
        percent = f" ({100 * p.rows_done / p.rows_total:.1f}%)" if p.rows_total else ""
        return (
            f"[cbrun generate --ray] rows {p.rows_done}{total}{percent} | {p.replicas} replicas | "
            f"out {rate:,.0f} tok/s now, {p.completion_tokens / max(p.elapsed_s, 1e-9):,.0f} tok/s overall | "
            f"errors {p.rows_failed} | {p.elapsed_s:,.0f} s"
        )

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            print(self.line(), file=self.stream, flush=True)


def summary(progress: RayProgress, output: str) -> list[str]:
    """The end-of-job lines: rows, tokens, wall time and rates."""
    p = progress
    elapsed = max(p.elapsed_s, 1e-9)
    return [
        f"rows {p.rows_done:,} (failed {p.rows_failed:,}), output rows {p.samples_written:,}, "
        f"on {p.replicas} Ray replicas",
        f"prompt tokens {p.prompt_tokens:,}, completion tokens {p.completion_tokens:,}, wall time {elapsed:,.1f} s",
        f"output tokens/s {p.completion_tokens / elapsed:,.1f}, rows/s {p.rows_done / elapsed:,.2f}",
        f"output: {output}",
    ]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__
