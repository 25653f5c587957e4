"""Running a job on this machine from the command line, as generate and score both do.

`run_local_job(plan)` is the whole run once the options, INPUT and OUTPUT
are checked into a `JobPlan`: stdout claimed for data when OUTPUT is `-`, the
model loaded and the engine started with one-line errors, the job built from
what the command brings (its parts: preparer, output format and row kind),
the dashboard, Ctrl-C and SIGTERM turned into the job's stops, the output
closed whatever happens, and the summary line with the exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from cbrun.cli.choices import Device, Dtype
from cbrun.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_ROWS_FAILED, CliError, first_line, load_model
from cbrun.process_memory import format_bytes, peak_rss_bytes

if TYPE_CHECKING:
    from cbrun.cli.output_target import OutputTarget
    from cbrun.dashboard import Dashboard
    from cbrun.data.job import Job, JobProgress, PartsPlan, RowWriter
    from cbrun.data.reader import RawRow
    from cbrun.data.resume import ResumeState
    from cbrun.engine import Engine, EngineConfig
    from cbrun.engine.model_spec import CausalLM, Tokenizer
    from cbrun.scale.shards import Shard


@dataclass(frozen=True)
class ModelChoice:
    """--model and how to load it (`ModelOptions`' values)."""

    name: str
    dtype: Dtype
    device: Device
    revision: str | None = None


@dataclass
class JobPlan:
    """A job checked and ready to run on this machine: all of it decided before the model loads.

    title: the dashboard's ("cbrun generate"); rows_total: None when unknown (a shard's);
    resume: what an earlier run wrote (None without --resume); parts: the command's preparer, output
    format and row kind, made once the model is loaded; shard: this process's shard, if sharded.
    """

    title: str
    model: ModelChoice
    engine_config: EngineConfig
    target: OutputTarget
    rows: Iterable[RawRow]
    rows_total: int | None
    resume: ResumeState | None
    parts: PartsPlan
    window: int
    quiet: bool
    shard: Shard | None = None


def run_local_job(plan: JobPlan) -> int:
    """Run the job on this machine into OUTPUT; returns the exit code."""
    from cbrun.data.job import Job, JobProgress

    with claim_stdout(plan.target.kind == "stdout") as data_stream:
        model, tokenizer = _load_model(plan)
        engine = _start_engine(model, tokenizer, plan.engine_config)
        try:
            parts = plan.parts.build(tokenizer, engine)
            writer = plan.target.open_writer(parts.fmt, data_stream, append=plan.resume is not None)
            progress = JobProgress(rows_total=plan.rows_total)
            job = Job(
                engine,
                plan.rows,
                parts.preparer,
                parts.fmt,
                writer,
                kind=parts.kind,
                openai=parts.openai,
                resume=plan.resume,
                window=plan.window,
                progress=progress,
            )
            dashboard = None if plan.quiet else _dashboard(engine, progress, plan.title)
            _run_to_end(job, writer, dashboard)
        finally:
            engine.destroy(give_back_weights=False)  # the model is not used again: no second copy at exit
    return _report(progress, dashboard, plan.target, plan.shard)


@contextlib.contextmanager
def claim_stdout(claim: bool) -> Iterator[IO[bytes] | None]:
    """With OUTPUT `-`, data goes to the real stdout and everything else printed goes to stderr."""
    if not claim:
        yield None
        return
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # stdout replaced (tests): write to it directly
        yield sys.stdout.buffer
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    data = os.fdopen(os.dup(fd), "wb")
    os.dup2(sys.stderr.fileno(), fd)
    try:
        yield data
    finally:
        with contextlib.suppress(BrokenPipeError):
            data.close()
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def _load_model(plan: JobPlan) -> tuple[CausalLM, Tokenizer]:
    """(model, tokenizer) of --model as the plan asks; --chat needs a chat template."""
    choice = plan.model
    model, tokenizer = load_model(choice.name, choice.dtype, choice.device, choice.revision)
    if plan.parts.chat and not getattr(tokenizer, "chat_template", None):
        raise CliError(f"--chat: the tokenizer of {choice.name!r} has no chat template")
    return model, tokenizer


def _start_engine(model: CausalLM, tokenizer: Tokenizer, config: EngineConfig) -> Engine:
    from cbrun.engine import ConfigError, Engine, UnsupportedModelError

    try:
        return Engine(model, tokenizer, config)
    except (ConfigError, UnsupportedModelError, MemoryError, RuntimeError, ValueError) as exc:
        raise CliError(f"cannot start the engine: {first_line(exc)}") from None


def _dashboard(engine: Engine, progress: JobProgress, title: str) -> Dashboard:
    """The live view on stderr, with the engine's linear kernels when it has them."""
    from cbrun.dashboard import Dashboard

    dashboard = Dashboard(engine.stats, progress, stream=sys.stderr, title=title)
    if hasattr(engine, "linear_kernels"):
        dashboard.notes.append(("linear kernels", engine.linear_kernels()))
    if hasattr(engine, "weight_bytes"):
        dashboard.notes.append(("weights held", format_bytes(engine.weight_bytes())))
    return dashboard


def _run_to_end(job: Job, writer: RowWriter, dashboard: Dashboard | None) -> None:
    """Run the job to its end (or its stop), then close the output: a late Ctrl-C loses nothing."""
    from cbrun.data.reader import InputError

    with _interrupts(job, dashboard):  # held until the output is closed
        try:
            with dashboard or contextlib.nullcontext():
                job.run()
        except InputError as exc:
            raise CliError(
                f"{exc}; the rows written so far are kept (finish with --resume)", EXIT_ROWS_FAILED
            ) from None
        except BrokenPipeError:  # `cbrun generate ... - | head`: the reader has enough
            raise CliError("stopped: the reader of stdout closed the pipe", EXIT_ROWS_FAILED) from None
        finally:
            with contextlib.suppress(BrokenPipeError):
                writer.close()


@contextlib.contextmanager
def _interrupts(job: Job, dashboard: Dashboard | None) -> Iterator[None]:
    """First Ctrl-C: stop reading input and finish what is in flight; second (or SIGTERM): stop now."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    count = [0]

    def on_signal(signum, frame):
        count[0] += 1
        hard = count[0] > 1 or signum == signal.SIGTERM
        job.stop(hard=hard)
        if dashboard is not None:
            dashboard.note(
                "stopping now; writing finished rows"
                if hard
                else "stopping: finishing the requests in flight (Ctrl-C again to stop now)"
            )

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report(progress: JobProgress, dashboard: Dashboard | None, target: OutputTarget, shard: Shard | None) -> int:
    """The summary (with the dashboard) and its last line; returns the exit code."""
    where = target.where
    if shard is not None:
        where += f" (shard {shard.index} of {shard.count})"
    if progress.interrupted:
        code = EXIT_INTERRUPTED
        line = (
            f"interrupted: {progress.rows_done} rows done; run the same command with --resume to finish"
            if target.path is not None
            else f"interrupted: {progress.rows_done} rows done"
        )
    elif progress.rows_failed:
        code = EXIT_ROWS_FAILED
        line = f"{progress.rows_failed} of {progress.rows_done} rows failed (see the error column of {where})"
    else:
        code = EXIT_OK
        line = f"{progress.rows_done} rows done, written to {where}"
    if dashboard is not None:
        extra = [("output", where if shard is None else target.where)]
        if shard is not None:
            extra.append(("shard", shard.describe()))
        extra.append(("peak RSS", format_bytes(peak_rss_bytes())))
        dashboard.print_summary(extra)
        dashboard.note(line)
    return code
