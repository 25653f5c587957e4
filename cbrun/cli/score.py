"""`cbrun score INPUT OUTPUT`: teacher-forced logprobs of given completions, through generate's machinery.

Same input readers, output writers, `--resume`, dashboard, interrupts, exit
codes and error rows as `cbrun generate`; only the rows (see
`cbrun.data.score`) and the engine requests (scoring, not sampling) differ.
Usage problems are refused with one line and exit code 2 before the model loads.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Annotated, Optional

import typer

from cbrun.cli.common import (
    DEFAULT_MODEL,
    EXIT_ROWS_FAILED,
    CliError,
    CpuOffloadOption,
    Device,
    DeviceOption,
    Dtype,
    DtypeOption,
    KernelsOption,
    MaxBatchTokensOption,
    MaxMemoryPercentOption,
    MaxRequestsPerBatchOption,
    ModelOption,
    NoPrefixCacheOption,
    NumBlocksOption,
    PageSizeOption,
    SafetyMarginOption,
    SchedulerOption,
    build_engine_config,
    check_input_output,
    load_model,
    quiet_libraries,
)
from cbrun.cli.generate import OutputTarget, _claim_stdout, _interrupts, _report, _start_engine

INPUT_PANEL, OUTPUT_PANEL = "Input", "Output"


@dataclass
class ScoreOptions:
    """The command line, as values (see `score` for what each means)."""

    input: str | None
    output: str | None
    model: str = DEFAULT_MODEL
    dataset: str | None = None
    split: str | None = None
    prompt_column: str | None = None
    chat: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    keep_columns: str | None = None
    resume: bool = False
    overwrite: bool = False
    quiet: bool = False
    window: int = 4096
    dtype: Dtype = Dtype.auto
    device: Device = Device.auto
    engine: dict = field(default_factory=dict)  # build_engine_config keyword arguments


def score(
    input: Annotated[
        Optional[str],
        typer.Argument(
            help="Rows of prompt + completion(s): .jsonl/.json, .parquet, saved HF dataset, or - (stdin); "
            "`cbrun generate --prompt-token-ids` output works as it is.",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Optional[str],
        typer.Argument(
            help="Results: .jsonl or .parquet (by extension), or - for JSON Lines on stdout.", show_default=False
        ),
    ] = None,
    model: ModelOption = DEFAULT_MODEL,
    dataset: Annotated[
        Optional[str],
        typer.Option(
            help="A Hugging Face dataset (saved directory or name in the local cache) instead of INPUT.",
            rich_help_panel=INPUT_PANEL,
        ),
    ] = None,
    split: Annotated[
        Optional[str],
        typer.Option(help="Dataset split (default: train, or the only one).", rich_help_panel=INPUT_PANEL),
    ] = None,
    prompt_column: Annotated[
        Optional[str],
        typer.Option(
            help="Column holding the prompt instead of prompt_token_ids/prompt/messages/input_ids.",
            rich_help_panel=INPUT_PANEL,
        ),
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Apply the chat template to text prompts too.", rich_help_panel=INPUT_PANEL)
    ] = False,
    window: Annotated[
        int, typer.Option(help="Read-ahead window: input rows in flight, prefix-sorted.", rich_help_panel=INPUT_PANEL)
    ] = 4096,
    top_logprobs: Annotated[
        int,
        typer.Option(help="Add top_logprobs: the K most likely tokens at each position.", rich_help_panel=OUTPUT_PANEL),
    ] = 0,
    prompt_logprobs: Annotated[
        bool,
        typer.Option(
            "--prompt-logprobs",
            help="Add prompt_logprobs (one per prompt token, the first null); computes every "
            "prompt position, so completions no longer share a cached prompt.",
            rich_help_panel=OUTPUT_PANEL,
        ),
    ] = False,
    keep_columns: Annotated[
        Optional[str], typer.Option(help="Input columns to copy to the output (a,b,c).", rich_help_panel=OUTPUT_PANEL)
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Finish an interrupted job: keep OUTPUT's rows, do the rest.", rich_help_panel=OUTPUT_PANEL
        ),
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing OUTPUT.", rich_help_panel=OUTPUT_PANEL)
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Nothing on stderr but errors.", rich_help_panel=OUTPUT_PANEL)
    ] = False,
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
    kernels: KernelsOption = None,
) -> int:
    """Score given completions: per-token logprobs (temperature 1), their sum, and whether each was greedy."""
    engine = dict(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        scheduler=scheduler,
        safety_margin=safety_margin,
        no_prefix_cache=no_prefix_cache,
        cpu_offload_gb=cpu_offload_gb,
        max_memory_percent=max_memory_percent,
        kernels=kernels,
    )
    options = ScoreOptions(
        input=input,
        output=output,
        model=model,
        dataset=dataset,
        split=split,
        prompt_column=prompt_column,
        chat=chat,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        keep_columns=keep_columns,
        resume=resume,
        overwrite=overwrite,
        quiet=quiet,
        window=window,
        dtype=dtype,
        device=device,
        engine=engine,
    )
    return run_score(options)


def run_score(opts: ScoreOptions) -> int:
    """The whole command; returns the exit code (raises CliError for usage problems)."""
    from cbrun.data.job import GenerateJob, JobProgress
    from cbrun.data.reader import InputError
    from cbrun.data.score import ScoreFormat, ScorePreparer, ScoreRows

    quiet_libraries(opts.quiet)
    check_input_output(opts)
    if opts.top_logprobs < 0:
        raise CliError(f"--top-logprobs must be >= 0, got {opts.top_logprobs}")
    engine_config = build_engine_config(**opts.engine)
    keep = _keep_columns(opts.keep_columns)
    target = OutputTarget.parse(opts.output, opts.input)
    source = _open_input(opts, keep)
    fmt = ScoreFormat(top_logprobs=opts.top_logprobs > 0, prompt_logprobs=opts.prompt_logprobs, keep_columns=keep)
    target.check_existing(opts.resume, opts.overwrite)
    resume_state = _resume_state(target) if opts.resume else None

    with _claim_stdout(target.kind == "stdout") as data_stream:
        model, tokenizer = load_model(opts.model, opts.dtype, opts.device)
        if opts.chat and not getattr(tokenizer, "chat_template", None):
            raise CliError(f"--chat: the tokenizer of {opts.model!r} has no chat template")
        engine = _start_engine(model, tokenizer, engine_config)
        try:
            preparer = ScorePreparer(
                tokenizer,
                max_context=engine.max_context,
                vocab_size=engine.vocab_size,
                prompt_column=opts.prompt_column,
                chat=opts.chat,
                keep_columns=keep,
            )
            writer = target.open_writer(fmt, data_stream, append=opts.resume)
            progress = JobProgress(rows_total=source.total)
            job = GenerateJob(
                engine,
                source,
                preparer,
                fmt,
                writer,
                kind=ScoreRows(prompt_logprobs=opts.prompt_logprobs, top_logprobs=opts.top_logprobs),
                resume=resume_state,
                window=opts.window,
                progress=progress,
            )
            dashboard = None if opts.quiet else _dashboard(engine, progress)
            with _interrupts(job, dashboard):  # held until the output is closed: a late Ctrl-C loses nothing
                try:
                    with dashboard or contextlib.nullcontext():
                        job.run()
                except InputError as exc:
                    raise CliError(
                        f"{exc}; the rows written so far are kept (finish with --resume)", EXIT_ROWS_FAILED
                    ) from None
                except BrokenPipeError:
                    raise CliError("stopped: the reader of stdout closed the pipe", EXIT_ROWS_FAILED) from None
                finally:
                    with contextlib.suppress(BrokenPipeError):
                        writer.close()
        finally:
            engine.destroy()
    return _report(progress, dashboard, target, opts)


def _keep_columns(text: str | None) -> tuple[str, ...]:
    from cbrun.data.score import SCORE_COLUMNS

    names = tuple(c.strip() for c in (text or "").split(",") if c.strip())
    clash = [c for c in names if c in SCORE_COLUMNS]
    if clash:
        raise CliError(f"--keep-columns: {', '.join(clash)} would overwrite output columns")
    return names


def _open_input(opts: ScoreOptions, keep: tuple[str, ...]):
    from cbrun.data.prompts import ID_FIELDS, PROMPT_FIELDS
    from cbrun.data.reader import InputError, open_input
    from cbrun.data.score import COMPLETION_FIELDS, SCORE_PROMPT_IDS

    columns = {*ID_FIELDS, *PROMPT_FIELDS, *COMPLETION_FIELDS, SCORE_PROMPT_IDS, "sample", "error", *keep}
    if opts.prompt_column:
        columns.add(opts.prompt_column)
    try:
        return open_input(opts.input, dataset=opts.dataset, split=opts.split, columns=columns)
    except InputError as exc:
        raise CliError(str(exc)) from None


def _resume_state(target: OutputTarget):
    """What OUTPUT already holds (read, and repaired after a kill, before the model loads)."""
    from cbrun.data.resume import ResumeError, load_resume_state
    from cbrun.data.score import ScoreFormat

    try:
        return load_resume_state(target.path, target.kind, ScoreFormat.classify)
    except ResumeError as exc:
        raise CliError(str(exc)) from None


def _dashboard(engine, progress):
    from cbrun.dashboard import Dashboard

    return Dashboard(engine.stats, progress, stream=sys.stderr, title="cbrun score")
