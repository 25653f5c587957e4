"""`cbrun generate INPUT OUTPUT`: parse options, wire reader -> job -> writer, report.

Everything that can be refused (options, input, output, resume state, model)
is checked before any generation starts, and refused with one line and exit
code 2. The logic itself lives in `cbrun.data` (job, readers, writers, resume)
and `cbrun.dashboard`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from cbrun.cli.common import (DEFAULT_MODEL, EXIT_INTERRUPTED, EXIT_OK, EXIT_ROWS_FAILED, CliError,
                              CpuOffloadOption, Device, DeviceOption, Dtype, DtypeOption, MaxBatchTokensOption,
                              MaxMemoryPercentOption, MaxRequestsPerBatchOption, ModelOption, NoPrefixCacheOption,
                              NumBlocksOption, PageSizeOption, SafetyMarginOption, SchedulerOption, build_engine_config,
                              first_line, load_model, quiet_libraries)

INPUT_PANEL, SAMPLING_PANEL, OUTPUT_PANEL = "Input", "Sampling (rows may override)", "Output"


class OutputFormat(str, Enum):
    auto = "auto"
    cbrun = "cbrun"
    openai = "openai"


@dataclass
class GenerateOptions:
    """The command line, as values (see `generate` for what each means)."""

    input: str | None
    output: str | None
    model: str = DEFAULT_MODEL
    dataset: str | None = None
    split: str | None = None
    prompt_column: str | None = None
    chat: bool = False
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    keep_columns: str | None = None
    prompt_token_ids: bool = False
    format: OutputFormat = OutputFormat.auto
    resume: bool = False
    overwrite: bool = False
    quiet: bool = False
    window: int = 4096
    dtype: Dtype = Dtype.auto
    device: Device = Device.auto
    engine: dict = field(default_factory=dict)  # build_engine_config keyword arguments


def generate(
    input: Annotated[Optional[str], typer.Argument(
        help="Prompts: .jsonl/.json file, .parquet file or directory, saved HF dataset directory, or - (stdin).",
        show_default=False)] = None,
    output: Annotated[Optional[str], typer.Argument(
        help="Results: .jsonl or .parquet (by extension), or - for JSON Lines on stdout.", show_default=False)] = None,
    model: ModelOption = DEFAULT_MODEL,
    dataset: Annotated[Optional[str], typer.Option(
        help="A Hugging Face dataset (saved directory or name in the local cache) instead of INPUT.",
        rich_help_panel=INPUT_PANEL)] = None,
    split: Annotated[Optional[str], typer.Option(help="Dataset split (default: train, or the only one).",
                                                 rich_help_panel=INPUT_PANEL)] = None,
    prompt_column: Annotated[Optional[str], typer.Option(
        help="Column holding the prompt (text, chat messages or token ids) instead of prompt/messages/input_ids.",
        rich_help_panel=INPUT_PANEL)] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Apply the chat template to text prompts too.",
                                       rich_help_panel=INPUT_PANEL)] = False,
    window: Annotated[int, typer.Option(help="Read-ahead window: input rows in flight, prefix-sorted.",
                                        rich_help_panel=INPUT_PANEL)] = 4096,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.",
                                            rich_help_panel=SAMPLING_PANEL)] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy.", rich_help_panel=SAMPLING_PANEL)] = 1.0,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus sampling (default off: 1.0).",
                                                   rich_help_panel=SAMPLING_PANEL)] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Top-k sampling (default off: 0).",
                                                 rich_help_panel=SAMPLING_PANEL)] = None,
    min_p: Annotated[Optional[float], typer.Option(help="Min-p sampling (default off: 0).",
                                                   rich_help_panel=SAMPLING_PANEL)] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed: same seed, same samples, whatever the batch.",
                                                rich_help_panel=SAMPLING_PANEL)] = None,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt.", rich_help_panel=SAMPLING_PANEL)] = 1,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).",
                                                      rich_help_panel=SAMPLING_PANEL)] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at end-of-sequence tokens.",
                                             rich_help_panel=SAMPLING_PANEL)] = False,
    logprobs: Annotated[bool, typer.Option("--logprobs", help="Add the logprobs column (one per token).",
                                           rich_help_panel=OUTPUT_PANEL)] = False,
    top_logprobs: Annotated[int, typer.Option(help="Add top_logprobs: the K most likely tokens at each step.",
                                              rich_help_panel=OUTPUT_PANEL)] = 0,
    keep_columns: Annotated[Optional[str], typer.Option(help="Input columns to copy to the output (a,b,c).",
                                                        rich_help_panel=OUTPUT_PANEL)] = None,
    prompt_token_ids: Annotated[bool, typer.Option("--prompt-token-ids", help="Add the prompt_token_ids column.",
                                                   rich_help_panel=OUTPUT_PANEL)] = False,
    format: Annotated[OutputFormat, typer.Option(
        help="auto: OpenAI Batch output for OpenAI Batch input (JSON Lines), else cbrun rows.",
        rich_help_panel=OUTPUT_PANEL)] = OutputFormat.auto,
    resume: Annotated[bool, typer.Option("--resume", help="Finish an interrupted job: keep OUTPUT's rows, do the rest.",
                                         rich_help_panel=OUTPUT_PANEL)] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing OUTPUT.",
                                            rich_help_panel=OUTPUT_PANEL)] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Nothing on stderr but errors.",
                                        rich_help_panel=OUTPUT_PANEL)] = False,
    dtype: DtypeOption = Dtype.auto,
    device: DeviceOption = Device.auto,
    page_size: PageSizeOption = None,
    num_blocks: NumBlocksOption = None,
    max_batch_tokens: MaxBatchTokensOption = None,
    max_requests_per_batch: MaxRequestsPerBatchOption = None,
    scheduler: SchedulerOption = None,
    safety_margin: SafetyMarginOption = None,
    no_prefix_cache: NoPrefixCacheOption = False,
    cpu_offload_gb: CpuOffloadOption = None,
    max_memory_percent: MaxMemoryPercentOption = None,
) -> int:
    """Run a prompt dataset through the engine; write one row per (prompt, sample) as results finish."""
    engine = dict(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                  max_requests_per_batch=max_requests_per_batch, scheduler=scheduler, safety_margin=safety_margin,
                  no_prefix_cache=no_prefix_cache, cpu_offload_gb=cpu_offload_gb,
                  max_memory_percent=max_memory_percent)
    options = GenerateOptions(
        input=input, output=output, model=model, dataset=dataset, split=split, prompt_column=prompt_column,
        chat=chat, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        seed=seed, n=n, stop=list(stop or []), ignore_eos=ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs,
        keep_columns=keep_columns, prompt_token_ids=prompt_token_ids, format=format, resume=resume,
        overwrite=overwrite, quiet=quiet, window=window, dtype=dtype, device=device, engine=engine)
    return run_generate(options)


def run_generate(opts: GenerateOptions) -> int:
    """The whole command; returns the exit code (raises CliError for usage problems)."""
    from cbrun.data.job import GenerateJob, JobProgress
    from cbrun.data.prompts import RowPreparer
    from cbrun.data.reader import InputError

    quiet_libraries(opts.quiet)
    if opts.dataset is not None and opts.output is None:
        opts.input, opts.output = None, opts.input
    elif opts.dataset is not None and opts.input is not None:
        raise CliError("give either INPUT or --dataset, not both")
    if opts.output is None:
        raise CliError("missing OUTPUT (a .jsonl or .parquet path, or - for stdout)")
    if opts.window < 1:
        raise CliError(f"--window must be at least 1, got {opts.window}")
    sampling = _sampling(opts)
    engine_config = build_engine_config(**opts.engine)
    keep = _keep_columns(opts.keep_columns)
    target = OutputTarget.parse(opts.output, opts.input)
    source = _open_input(opts, keep)
    openai_input = _is_openai_input(source)
    fmt_name = _choose_format(opts.format, openai_input, target)
    target.check_existing(opts.resume, opts.overwrite)
    resume_state = _resume_state(target, fmt_name) if opts.resume else None

    with _claim_stdout(target.kind == "stdout") as data_stream:
        model, tokenizer = load_model(opts.model, opts.dtype, opts.device)
        if opts.chat and not getattr(tokenizer, "chat_template", None):
            raise CliError(f"--chat: the tokenizer of {opts.model!r} has no chat template")
        fmt, converter = _formats(fmt_name, openai_input, tokenizer, opts, keep)
        engine = _start_engine(model, tokenizer, engine_config)
        try:
            preparer = RowPreparer(tokenizer, sampling, max_context=engine.max_context, vocab_size=engine.vocab_size,
                                   prompt_column=opts.prompt_column, chat=opts.chat, keep_columns=keep)
            writer = target.open_writer(fmt, data_stream, append=opts.resume)
            progress = JobProgress(rows_total=source.total)
            job = GenerateJob(engine, source, preparer, fmt, writer, openai=converter, resume=resume_state,
                              window=opts.window, progress=progress)
            dashboard = None if opts.quiet else _dashboard(engine, progress)
            with _interrupts(job, dashboard):  # held until the output is closed: a late Ctrl-C loses nothing
                try:
                    with dashboard or contextlib.nullcontext():
                        job.run()
                except InputError as exc:
                    raise CliError(f"{exc}; the rows written so far are kept (finish with --resume)",
                                   EXIT_ROWS_FAILED) from None
                except BrokenPipeError:  # `cbrun generate ... - | head`: the reader has enough
                    raise CliError("stopped: the reader of stdout closed the pipe", EXIT_ROWS_FAILED) from None
                finally:
                    with contextlib.suppress(BrokenPipeError):
                        writer.close()
        finally:
            engine.destroy()
    return _report(progress, dashboard, target, opts)


# --- checks before any work -------------------------------------------------------


@dataclass
class OutputTarget:
    """Where results go: kind is "stdout", "jsonl" or "parquet"."""

    kind: str
    path: Path | None

    @classmethod
    def parse(cls, spec: str, input_spec: str | None) -> "OutputTarget":
        if spec == "-":
            return cls("stdout", None)
        path = Path(spec)
        suffix = path.suffix.lower()
        kind = "parquet" if suffix == ".parquet" else "jsonl" if suffix in (".jsonl", ".json", ".ndjson") else None
        if kind is None:
            raise CliError(f"unknown output format: {spec} (use .jsonl, .parquet or - for stdout)")
        if not path.parent.is_dir():
            raise CliError(f"output directory does not exist: {path.parent}")
        if input_spec not in (None, "-") and Path(input_spec).resolve() == path.resolve():
            raise CliError("OUTPUT must not be the INPUT file")
        return cls(kind, path)

    def existing(self) -> list[Path]:
        from cbrun.data.writers import journal_path

        if self.path is None:
            return []
        candidates = [self.path] + ([journal_path(self.path)] if self.kind == "parquet" else [])
        return [p for p in candidates if p.exists()]

    def check_existing(self, resume: bool, overwrite: bool) -> None:
        if resume and overwrite:
            raise CliError("--resume and --overwrite contradict each other")
        if resume and self.kind == "stdout":
            raise CliError("--resume needs an OUTPUT file (not -)")
        found = self.existing()
        if found and not resume and not overwrite:
            raise CliError(f"{found[0]} exists (use --resume to finish that job, or --overwrite to replace it)")

    def open_writer(self, fmt, data_stream, append: bool):
        from cbrun.data.writers import JsonlWriter, ParquetOutput

        if self.kind == "stdout":
            return JsonlWriter(data_stream, fsync=False)
        if not append:
            for path in self.existing():
                path.unlink()
        if self.kind == "parquet":
            return ParquetOutput(self.path, fmt)
        return JsonlWriter.open(self.path, append=append)


def _sampling(opts: GenerateOptions):
    from cbrun.engine import ConfigError, SamplingParams

    values = dict(max_tokens=opts.max_tokens, temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k,
                  min_p=opts.min_p, seed=opts.seed, n=opts.n, stop=tuple(opts.stop), ignore_eos=opts.ignore_eos,
                  top_logprobs=opts.top_logprobs)
    try:
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})
    except ConfigError as exc:
        raise CliError(f"invalid sampling option: {exc}") from None


def _keep_columns(text: str | None) -> tuple[str, ...]:
    from cbrun.data.schema import BASE_COLUMNS

    names = tuple(c.strip() for c in (text or "").split(",") if c.strip())
    clash = [c for c in names if c in BASE_COLUMNS]
    if clash:
        raise CliError(f"--keep-columns: {', '.join(clash)} would overwrite output columns")
    return names


def _open_input(opts: GenerateOptions, keep: tuple[str, ...]):
    from cbrun.data.prompts import ID_FIELDS, PROMPT_FIELDS, SAMPLING_OVERRIDES
    from cbrun.data.reader import InputError, open_input

    columns = {*ID_FIELDS, *PROMPT_FIELDS, *SAMPLING_OVERRIDES, *keep, "method", "url", "body"}
    if opts.prompt_column:
        columns.add(opts.prompt_column)
    try:
        return open_input(opts.input, dataset=opts.dataset, split=opts.split, columns=columns)
    except InputError as exc:
        raise CliError(str(exc)) from None


def _is_openai_input(source) -> bool:
    from cbrun.data.openai_batch import looks_like_openai_batch

    first = source.peek()
    return first is not None and looks_like_openai_batch(first.record)


def _choose_format(requested: OutputFormat, openai_input: bool, target: OutputTarget) -> str:
    if requested == OutputFormat.openai:
        if not openai_input:
            raise CliError("--format openai needs OpenAI Batch API input (lines with custom_id, url and body)")
        if target.kind == "parquet":
            raise CliError("--format openai writes JSON Lines; use a .jsonl OUTPUT or - ")
        return "openai"
    if requested == OutputFormat.auto and openai_input and target.kind != "parquet":
        return "openai"
    return "cbrun"


def _formats(name: str, openai_input: bool, tokenizer, opts: GenerateOptions, keep: tuple[str, ...]):
    """(output format, OpenAI request converter or None)."""
    from cbrun.data.openai_batch import OpenAIFormat
    from cbrun.data.schema import CbrunFormat

    converter = OpenAIFormat(tokenizer, opts.model) if openai_input else None
    if name == "openai":
        return converter, converter
    fmt = CbrunFormat(logprobs=opts.logprobs, top_logprobs=opts.top_logprobs > 0,
                      prompt_token_ids=opts.prompt_token_ids, keep_columns=keep)
    return fmt, converter


def _resume_state(target: OutputTarget, fmt_name: str):
    """What OUTPUT already holds (read, and repaired after a kill, before the model loads)."""
    from cbrun.data.openai_batch import OpenAIFormat
    from cbrun.data.resume import ResumeError, load_resume_state
    from cbrun.data.schema import CbrunFormat

    classify = OpenAIFormat.classify if fmt_name == "openai" else CbrunFormat.classify
    try:
        return load_resume_state(target.path, target.kind, classify)
    except ResumeError as exc:
        raise CliError(str(exc)) from None


def _start_engine(model, tokenizer, config):
    from cbrun.engine import ConfigError, Engine, UnsupportedModelError

    try:
        return Engine(model, tokenizer, config)
    except (ConfigError, UnsupportedModelError, MemoryError, RuntimeError, ValueError) as exc:
        raise CliError(f"cannot start the engine: {first_line(exc)}") from None


# --- running ---------------------------------------------------------------------


@contextlib.contextmanager
def _claim_stdout(claim: bool):
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


def _dashboard(engine, progress):
    from cbrun.dashboard import Dashboard

    return Dashboard(engine.stats, progress, stream=sys.stderr, title="cbrun generate")


@contextlib.contextmanager
def _interrupts(job, dashboard):
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
            dashboard.note("stopping now; writing finished rows" if hard else
                           "stopping: finishing the requests in flight (Ctrl-C again to stop now)")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report(progress, dashboard, target: OutputTarget, opts: GenerateOptions) -> int:
    where = "stdout" if target.path is None else str(target.path)
    if progress.interrupted:
        code = EXIT_INTERRUPTED
        line = (f"interrupted: {progress.rows_done} rows done; run the same command with --resume to finish"
                if target.path is not None else f"interrupted: {progress.rows_done} rows done")
    elif progress.rows_failed:
        code = EXIT_ROWS_FAILED
        line = f"{progress.rows_failed} of {progress.rows_done} rows failed (see the error column of {where})"
    else:
        code = EXIT_OK
        line = f"{progress.rows_done} rows done, written to {where}"
    if dashboard is not None:
        dashboard.print_summary([("output", where)])
        dashboard.note(line)
    return code
