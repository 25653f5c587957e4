"""`cbrun generate --ray`: Ray workers read the input and write the output; the driver counts.

    driver: plan the input (file sizes, Parquet footers; `input_plan`)
        -> Ray tasks count JSON Lines ranges -> read tasks (`ray_source`), streamed with backpressure
        -> map_batches(PartWriter, K actors, blocks of B rows): each block a part file + manifest
        -> back to the driver: one row of counters per block (`BlockCounters`)
    when every row is written: one schema for all Parquet parts (`finalize`), duplicate ids (`id_check`)

The driver holds the plan, the ranges of rows already written (on --resume)
and counters: its memory does not grow with the input. A block whose actor
dies is run again by Ray on a restarted actor and overwrites its own part (see
`part_writer` for blocks that keep killing their worker). A killed driver
takes its local cluster and actors with it; the same command with --resume
reads the manifests and runs only the rows missing.

On a small machine an actor that reserves a whole CPU per engine can leave Ray
nothing for its own tasks and hang; by default a local cluster reserves at
most half the cores for engines, in fractions, and each engine's thread count
is set explicitly (`--threads-per-replica`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbrun.data.generate.format import CbrunFormat
from cbrun.scale.id_check import DuplicateIds, find_duplicate_ids
from cbrun.scale.input_plan import InputPlan
from cbrun.scale.output_dir import OutputState, manifest_paths
from cbrun.scale.part_store import BlockCounters, PartStore
from cbrun.scale.part_writer import PartWriter

BLOCKS_PER_REPLICA = 4  # small enough blocks that every replica stays busy to the end
UNITS_PER_REPLICA = 8  # read units (what one actor task takes at a time) per replica
READS_PER_REPLICA = 2  # read tasks running at once, per replica


class RayJobError(Exception):
    """Ray is missing, cannot start, or the job failed; one line."""


@dataclass
class RayProgress:
    """Counters of a Ray job, in input rows (earlier runs' rows included on --resume), read by the view."""

    rows_total: int | None = None
    rows_done: int = 0
    rows_skipped: int = 0  # found in OUTPUT by --resume
    rows_failed: int = 0
    samples_written: int = 0
    prompt_tokens: int = 0  # this run's
    completion_tokens: int = 0
    replicas: int = 0
    blocks: int = 0
    retried_blocks: int = 0
    given_up: int = 0
    parts_rewritten: int = 0
    missing_rows: int = 0  # input rows no part holds, found when the job ends (should be 0)
    doubled_rows: int = 0  # rows two parts hold (should be 0)
    duplicates: DuplicateIds | None = None
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    @property
    def complete(self) -> bool:
        return self.rows_total is not None and self.rows_done >= self.rows_total

    def resumed(self, state: OutputState) -> None:
        """Count what OUTPUT held when the run started."""
        self.rows_done = self.rows_skipped = state.counters.rows
        self.rows_failed = state.counters.failed
        self.given_up = state.counters.given_up

    def add(self, counters: BlockCounters) -> None:
        """Count one written block."""
        self.blocks += 1
        self.rows_done += counters.rows
        self.rows_failed += counters.failed
        self.samples_written += counters.samples
        self.prompt_tokens += counters.prompt_tokens
        self.completion_tokens += counters.completion_tokens
        self.retried_blocks += counters.retried
        self.given_up += counters.given_up


@dataclass(kw_only=True)
class RayJob:
    """What to run: the input plan, where parts go, the actors' arguments and how many actors."""

    plan: InputPlan
    store: PartStore
    fmt: CbrunFormat
    generator: dict  # PartWriter / CbrunGenerator keyword arguments (model, sampling, engine, columns)
    replicas: int
    threads: int
    cpus_per_replica: float
    window: int

    @property
    def parallelism(self) -> int:
        return self.replicas * UNITS_PER_REPLICA


def block_size(total: int | None, replicas: int, window: int) -> int:
    """Rows per block: BLOCKS_PER_REPLICA blocks per replica, at most `window` rows (memory, retry cost)."""
    if not total:
        return window
    return max(1, min(window, math.ceil(total / (replicas * BLOCKS_PER_REPLICA))))


def default_cpus(threads: int, replicas: int, local: bool) -> float:
    """CPUs each actor reserves: its threads on a cluster; on this machine, at most half the cores in all."""
    if not local:
        return float(threads)
    cores = os.cpu_count() or 1
    return max(0.05, min(float(threads), cores / 2 / replicas))


def start_ray(address: str | None, threads: int, quiet: bool, runtime_env: dict | None = None) -> None:
    """Join `address` or start a new local cluster whose workers import this same cbrun.

    A new one even where `ray start` ran on this machine or another process's cluster is up (ray.init's
    own default joins those): the local cluster is sized for this machine and ends with this job.

    runtime_env: merged into the job's runtime environment (its env_vars on top of cbrun's own).
    """
    try:
        import ray
        import ray.data
    except ImportError:
        raise RayJobError("--ray needs Ray Data: pip install 'cbrun[ray]'") from None

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a batch tool does not phone home by default
    env_vars = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if address is None:  # local workers: the cbrun the driver runs, even from a source checkout
        source_root = str(Path(__file__).resolve().parents[2])
        env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)
    env = dict(runtime_env or {})
    env["env_vars"] = {**env_vars, **env.get("env_vars", {})}
    try:
        ray.init(
            address=address or "local",  # "local": a new cluster, never one RAY_ADDRESS or `ray start` left behind
            include_dashboard=False,
            log_to_driver=not quiet,
            logging_level=logging.ERROR if quiet else logging.WARNING,
            runtime_env=env,
            ignore_reinit_error=True,
        )
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError ... from ray.init
        raise RayJobError(f"cannot start or join Ray{f' at {address}' if address else ''}: {first_line(exc)}") from None
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # our own view says rows done and tokens/s
    context.enable_operator_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.ERROR if quiet else logging.WARNING)


def start_board() -> Any:
    """The ProgressBoard actor the replicas report to (no CPU reserved)."""
    import ray

    from cbrun.scale.ray_view import ProgressBoard

    return ray.remote(num_cpus=0, max_restarts=-1)(ProgressBoard).remote()


def run_ray_job(
    job: RayJob, state: OutputState, progress: RayProgress, *, board: Any = None, udf: type = PartWriter
) -> None:
    """Run every row not in `state.done` through `job.replicas` actors of `udf` (PartWriter or a subclass,
    which gets `job.generator` plus the output's arguments); `progress` counts each block as it is written."""
    import ray
    import ray.data

    from cbrun.scale.ray_source import CbrunInput

    progress.replicas = job.replicas
    progress.rows_total = job.plan.total
    remaining = None if job.plan.total is None else job.plan.total - len(state.done)
    if remaining == 0:
        return
    size = block_size(remaining, job.replicas, job.window)
    arguments = {
        **job.generator,
        "threads": job.threads,
        "output": str(job.store.root),
        "output_kind": job.store.kind,
        "run": job.store.run,
        "board": board,
    }
    reads = ray.data.read_datasource(
        CbrunInput(job.plan, state.done), num_cpus=0, concurrency=max(1, job.replicas * READS_PER_REPLICA)
    )
    blocks = reads.map_batches(
        udf,
        fn_constructor_kwargs=arguments,
        batch_format="pyarrow",
        batch_size=size,  # the block: a part file, the unit of retry, prefix-sorted as one window
        compute=ray.data.ActorPoolStrategy(size=job.replicas),
        num_cpus=job.cpus_per_replica,
    )  # Ray Data restarts dead actors and retries their blocks
    try:
        for table in blocks.iter_batches(batch_format="pyarrow", batch_size=None):
            for values in table.to_pylist():
                progress.add(BlockCounters.from_dict(values))
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:  # RayTaskError, RayActorError, ...: the job as a whole failed
        raise RayJobError(f"the Ray job failed: {first_line(exc)}") from None
    finally:
        progress.finished = time.perf_counter()


def first_input_record(plan: InputPlan) -> dict | None:
    """The input's first record, read by a Ray task (is it OpenAI Batch requests?); None for no input.
    Raises InputError for unreadable input, RayJobError when Ray itself fails (a raylet died)."""
    from cbrun.data.reader import InputError
    from cbrun.scale.ray_source import probe_first_record

    if not plan.units:
        return None
    try:
        return probe_first_record(plan.units[0])
    except InputError:
        raise
    except Exception as exc:  # RaySystemError, LocalRayletDiedError, ...
        raise RayJobError(f"the Ray job failed: {first_line(exc)}") from None


def run_to_output(
    job: RayJob,
    progress: RayProgress,
    *,
    resume: bool,
    overwrite: bool,
    view: bool = True,
    udf: type = PartWriter,
) -> None:
    """The whole job once Ray runs: OUTPUT prepared (or read back, --resume), the input counted, the actors
    run with a live view on stderr, and the finished OUTPUT checked. Raises OutputError, InputError,
    RayJobError; KeyboardInterrupt leaves every part written so far."""
    import dataclasses

    from cbrun.scale.output_dir import prepare_output
    from cbrun.scale.ray_source import count_input
    from cbrun.scale.ray_view import RayView

    state = prepare_output(job.store, resume=resume, overwrite=overwrite, input_name=job.plan.name)
    job = dataclasses.replace(job, plan=count_input(job.plan, job.parallelism))
    progress.resumed(state)
    board = start_board()
    with RayView(progress, board) if view else contextlib.nullcontext():
        run_ray_job(job, state, progress, board=board, udf=udf)
    if progress.rows_total is None:  # a streamed dataset of unknown length has ended
        progress.rows_total = progress.rows_done
    finish_ray_job(job, progress)


def finish_ray_job(job: RayJob, progress: RayProgress) -> None:
    """When every row is written: OUTPUT checked against the input (every row once), one schema for all
    Parquet parts, then the job-wide duplicate-id check."""
    from cbrun.scale.finalize import finalize_parts, rewrite_with_ray
    from cbrun.scale.output_dir import part_files, scan_output

    state = scan_output(job.store)
    total = progress.rows_total or 0
    progress.missing_rows = total - len(state.done.within(0, total))
    progress.doubled_rows = state.counters.rows - len(state.done)
    if job.store.kind == "parquet":
        progress.parts_rewritten = finalize_parts(part_files(job.store), job.fmt, rewrite_with_ray)
    progress.duplicates = find_duplicate_ids(manifest_paths(job.store), progress.rows_total or progress.rows_done)
    job.store.end_run()
    progress.finished = time.perf_counter()


def summary(progress: RayProgress, output: str) -> list[str]:
    """The end-of-job lines: rows, tokens, wall time and rates, and what went wrong on the way."""
    p = progress
    elapsed = max(p.elapsed_s, 1e-9)
    worked = p.rows_done - p.rows_skipped
    lines = [
        f"rows {p.rows_done:,} (failed {p.rows_failed:,}"
        + (f", {p.rows_skipped:,} already in OUTPUT" if p.rows_skipped else "")
        + f"), output rows {p.samples_written:,} this run, on {p.replicas} Ray replicas",
        f"prompt tokens {p.prompt_tokens:,}, completion tokens {p.completion_tokens:,}, wall time {elapsed:,.1f} s",
        f"output tokens/s {p.completion_tokens / elapsed:,.1f}, rows/s {worked / elapsed:,.2f}",
    ]
    if p.retried_blocks or p.given_up:
        lines.append(
            f"{p.retried_blocks} blocks were run again in smaller pieces after their worker died"
            + (f"; {p.given_up} rows that killed their worker alone are error rows" if p.given_up else "")
        )
    if p.missing_rows or p.doubled_rows:
        lines.append(f"OUTPUT check: {p.missing_rows:,} input rows missing, {p.doubled_rows:,} written twice")
    if p.parts_rewritten:
        lines.append(f"{p.parts_rewritten} parts rewritten so that every part has the same columns")
    lines.append(f"output: {output} (a directory of part files)")
    return lines


def first_line(exc: BaseException) -> str:
    """The last non-blank line of an exception's text (Ray puts the cause last), or its type."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__
