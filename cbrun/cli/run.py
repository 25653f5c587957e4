"""Running a job on this machine from the command line, as generate and score both do.

`run_local_job` is the whole run once the options, INPUT and OUTPUT are
checked: stdout claimed for data when OUTPUT is `-`, the model loaded and the
engine started with one-line errors, the job built from what the command
brings (`JobParts`: its preparer, output format and row kind), the dashboard,
Ctrl-C and SIGTERM turned into the job's stops, the output closed whatever
happens, and the summary line with the exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from cbrun.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_ROWS_FAILED, CliError, first_line, load_model
from cbrun.process_memory import format_bytes, peak_rss_bytes

if TYPE_CHECKING:
    from cbrun.cli.output_target import OutputTarget
    from cbrun.data.job import GenerateJob, JobProgress, OutputFormat, RowKind
    from cbrun.data.openai_batch import OpenAIFormat
    from cbrun.data.prompts import RowPreparer
    from cbrun.data.reader import RawRow
    from cbrun.data.resume import ResumeState


@dataclass
class JobParts:
    """What a command brings to its job, made once the tokenizer and the engine exist."""

    preparer: RowPreparer
    fmt: OutputFormat
    kind: RowKind[Any] | None = None  # None: generated rows
    openai: OpenAIFormat | None = None  # OpenAI Batch API input: its converter


def preparer_args(opts, engine, keep: tuple[str, ...]) -> dict[str, Any]:
    """The preparer keywords generate and score share: the engine's limits and how prompts are read."""
    return dict(
        max_context=engine.max_context,
        vocab_size=engine.vocab_size,
        prompt_column=opts.prompt_column,
        chat=opts.chat,
        keep_columns=keep,
    )


def run_local_job(
    opts,
    target: OutputTarget,
    engine_config,
    rows: Iterable[RawRow],
    rows_total: int | None,
    resume: ResumeState | None,
    parts: Callable[[Any, Any], JobParts],
    title: str,
    shard=None,
) -> int:
    """Run the job on this machine into OUTPUT; returns the exit code.

    opts: the command's options (model, input, output and quiet bundles);
    parts(tokenizer, engine): the command's preparer, format and row kind.
    """
    from cbrun.data.job import GenerateJob, JobProgress

    with claim_stdout(target.kind == "stdout") as data_stream:
        model, tokenizer = _load_model(opts)
        engine = _start_engine(model, tokenizer, engine_config)
        try:
            made = parts(tokenizer, engine)
            writer = target.open_writer(made.fmt, data_stream, append=opts.resume)
            progress = JobProgress(rows_total=rows_total)
            job = GenerateJob(
                engine,
                rows,
                made.preparer,
                made.fmt,
                writer,
                kind=made.kind,
                openai=made.openai,
                resume=resume,
                window=opts.window,
                progress=progress,
            )
            dashboard = None if opts.quiet else _dashboard(engine, progress, title)
            _run_to_end(job, writer, dashboard)
        finally:
            engine.destroy(give_back_weights=False)  # the model is not used again: no second copy at exit
    return _report(progress, dashboard, target, shard)


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


def _load_model(opts) -> tuple[Any, Any]:
    """(model, tokenizer) of --model as the options ask; --chat needs a chat template."""
    model, tokenizer = load_model(opts.model, opts.dtype, opts.device, opts.revision)
    if opts.chat and not getattr(tokenizer, "chat_template", None):
        raise CliError(f"--chat: the tokenizer of {opts.model!r} has no chat template")
    return model, tokenizer


def _start_engine(model, tokenizer, config):
    from cbrun.engine import ConfigError, Engine, UnsupportedModelError

    try:
        return Engine(model, tokenizer, config)
    except (ConfigError, UnsupportedModelError, MemoryError, RuntimeError, ValueError) as exc:
        raise CliError(f"cannot start the engine: {first_line(exc)}") from None


def _dashboard(engine, progress: JobProgress, title: str):
    """The live view on stderr, with the engine's linear kernels when it has them."""
    from cbrun.dashboard import Dashboard

    dashboard = Dashboard(engine.stats, progress, stream=sys.stderr, title=title)
    if hasattr(engine, "linear_kernels"):
        dashboard.notes.append(("linear kernels", engine.linear_kernels()))
    if hasattr(engine, "weight_bytes"):
        dashboard.notes.append(("weights held", format_bytes(engine.weight_bytes())))
    return dashboard


def _run_to_end(job: GenerateJob, writer, dashboard) -> None:
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
def _interrupts(job: GenerateJob, dashboard) -> Iterator[None]:
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


def _report(progress: JobProgress, dashboard, target: OutputTarget, shard=None) -> int:
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
