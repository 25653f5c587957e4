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

from cbrun.cli.common import (
    DEFAULT_MODEL,
    EXIT_INTERRUPTED,
    EXIT_OK,
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
    RevisionOption,
    SafetyMarginOption,
    SchedulerOption,
    build_engine_config,
    check_input_output,
    first_line,
    load_model,
    quiet_libraries,
)

INPUT_PANEL, SAMPLING_PANEL, OUTPUT_PANEL = "Input", "Sampling (rows may override)", "Output"
SCALE_PANEL = "Past one machine (shards, Ray)"
STRUCTURED_PANEL = "Structured outputs (a row's json_schema/regex/choice/grammar/json_object overrides)"


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
    min_tokens: int = 0
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
    json_schema: str | None = None  # job-wide structured-output constraints (files for schema and grammar)
    regex: str | None = None
    choice: list[str] = field(default_factory=list)
    grammar: str | None = None
    masked_logprobs: bool = False
    keep_columns: str | None = None
    prompt_token_ids: bool = False
    format: OutputFormat = OutputFormat.auto
    resume: bool = False
    overwrite: bool = False
    quiet: bool = False
    window: int = 4096
    dtype: Dtype = Dtype.auto
    device: Device = Device.auto
    revision: str | None = None
    engine: dict = field(default_factory=dict)  # build_engine_config keyword arguments
    num_shards: int | None = None
    shard_index: int | None = None
    ray: bool = False
    ray_address: str | None = None
    replicas: int = 2
    threads_per_replica: int = 1
    cpus_per_replica: float | None = None


def generate(
    input: Annotated[
        Optional[str],
        typer.Argument(
            help="Prompts: .jsonl/.json file, .parquet file or directory, saved HF dataset directory, or - (stdin).",
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
            help="Column holding the prompt (text, chat messages or token ids) instead of prompt/messages/input_ids.",
            rich_help_panel=INPUT_PANEL,
        ),
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Apply the chat template to text prompts too.", rich_help_panel=INPUT_PANEL)
    ] = False,
    window: Annotated[
        int, typer.Option(help="Read-ahead window: input rows in flight, prefix-sorted.", rich_help_panel=INPUT_PANEL)
    ] = 4096,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.", rich_help_panel=SAMPLING_PANEL)] = 256,
    min_tokens: Annotated[
        int,
        typer.Option(
            help="Tokens generated before EOS, a stop id or a stop string may end a row.",
            rich_help_panel=SAMPLING_PANEL,
        ),
    ] = 0,
    temperature: Annotated[float, typer.Option(help="0 is greedy.", rich_help_panel=SAMPLING_PANEL)] = 1.0,
    top_p: Annotated[
        Optional[float], typer.Option(help="Nucleus sampling (default off: 1.0).", rich_help_panel=SAMPLING_PANEL)
    ] = None,
    top_k: Annotated[
        Optional[int], typer.Option(help="Top-k sampling (default off: 0).", rich_help_panel=SAMPLING_PANEL)
    ] = None,
    min_p: Annotated[
        Optional[float], typer.Option(help="Min-p sampling (default off: 0).", rich_help_panel=SAMPLING_PANEL)
    ] = None,
    seed: Annotated[
        Optional[int],
        typer.Option(help="Seed: same seed, same samples, whatever the batch.", rich_help_panel=SAMPLING_PANEL),
    ] = None,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt.", rich_help_panel=SAMPLING_PANEL)] = 1,
    stop: Annotated[
        Optional[list[str]], typer.Option(help="Stop string (repeatable).", rich_help_panel=SAMPLING_PANEL)
    ] = None,
    ignore_eos: Annotated[
        bool,
        typer.Option("--ignore-eos", help="Do not stop at end-of-sequence tokens.", rich_help_panel=SAMPLING_PANEL),
    ] = False,
    logprobs: Annotated[
        bool, typer.Option("--logprobs", help="Add the logprobs column (one per token).", rich_help_panel=OUTPUT_PANEL)
    ] = False,
    top_logprobs: Annotated[
        int, typer.Option(help="Add top_logprobs: the K most likely tokens at each step.", rich_help_panel=OUTPUT_PANEL)
    ] = 0,
    json_schema: Annotated[
        Optional[str],
        typer.Option(
            "--json-schema",
            metavar="FILE",
            help="Every output is JSON valid against this JSON schema file.",
            rich_help_panel=STRUCTURED_PANEL,
        ),
    ] = None,
    regex: Annotated[
        Optional[str],
        typer.Option(help="Every output matches this regular expression.", rich_help_panel=STRUCTURED_PANEL),
    ] = None,
    choice: Annotated[
        Optional[list[str]],
        typer.Option(help="Every output is one of these strings (repeatable).", rich_help_panel=STRUCTURED_PANEL),
    ] = None,
    grammar: Annotated[
        Optional[str],
        typer.Option(
            metavar="FILE",
            help="Every output follows this grammar (Lark or GBNF/EBNF text file).",
            rich_help_panel=STRUCTURED_PANEL,
        ),
    ] = None,
    masked_logprobs: Annotated[
        bool,
        typer.Option(
            "--masked-logprobs",
            help="Constrained rows (and rows under --min-tokens) report logprobs of the masked "
            "distribution they were sampled from (default: the model's, before the mask).",
            rich_help_panel=STRUCTURED_PANEL,
        ),
    ] = False,
    keep_columns: Annotated[
        Optional[str], typer.Option(help="Input columns to copy to the output (a,b,c).", rich_help_panel=OUTPUT_PANEL)
    ] = None,
    prompt_token_ids: Annotated[
        bool, typer.Option("--prompt-token-ids", help="Add the prompt_token_ids column.", rich_help_panel=OUTPUT_PANEL)
    ] = False,
    format: Annotated[
        OutputFormat,
        typer.Option(
            help="auto: OpenAI Batch output for OpenAI Batch input (JSON Lines), else cbrun rows.",
            rich_help_panel=OUTPUT_PANEL,
        ),
    ] = OutputFormat.auto,
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
    revision: RevisionOption = None,
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
    num_shards: Annotated[
        Optional[int],
        typer.Option(
            help="Split the input into N shards by a stable hash of each row's id; this process runs one. "
            "Default: SLURM_ARRAY_TASK_COUNT, CBRUN_NUM_SHARDS (with JOB_COMPLETION_INDEX) or WORLD_SIZE. "
            "Sharded, OUTPUT out.parquet becomes the directory out.parquet/ of part-IIIII-of-NNNNN.parquet "
            "files, unless OUTPUT names one file per shard with {shard} (e.g. out-{shard}.jsonl).",
            show_default=False,
            rich_help_panel=SCALE_PANEL,
        ),
    ] = None,
    shard_index: Annotated[
        Optional[int],
        typer.Option(
            help="The shard this process runs, 0..N-1. Default: SLURM_ARRAY_TASK_ID (minus SLURM_ARRAY_TASK_MIN), "
            "JOB_COMPLETION_INDEX or RANK.",
            show_default=False,
            rich_help_panel=SCALE_PANEL,
        ),
    ] = None,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Run on Ray (pip install 'cbrun\\[ray]'): --replicas engine actors; a Parquet OUTPUT "
            "becomes a directory of part files written as results finish; row order is not kept.",
            rich_help_panel=SCALE_PANEL,
        ),
    ] = False,
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            help="Ray cluster to join (ray://host:10001 or auto); default: start a local one.",
            show_default=False,
            rich_help_panel=SCALE_PANEL,
        ),
    ] = None,
    replicas: Annotated[
        int, typer.Option(help="With --ray: engine actors, one model copy each.", rich_help_panel=SCALE_PANEL)
    ] = 2,
    threads_per_replica: Annotated[
        int, typer.Option(help="With --ray: CPU threads of each engine.", rich_help_panel=SCALE_PANEL)
    ] = 1,
    cpus_per_replica: Annotated[
        Optional[float],
        typer.Option(
            help="With --ray: CPUs Ray reserves per actor; fractions let actors share cores "
            "(default: threads-per-replica, lowered to fit a local machine's cores).",
            show_default=False,
            rich_help_panel=SCALE_PANEL,
        ),
    ] = None,
) -> int:
    """Run a prompt dataset through the engine; write one row per (prompt, sample) as results finish."""
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
    options = GenerateOptions(
        input=input,
        output=output,
        model=model,
        dataset=dataset,
        split=split,
        prompt_column=prompt_column,
        chat=chat,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        n=n,
        stop=list(stop or []),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        json_schema=json_schema,
        regex=regex,
        choice=list(choice or []),
        grammar=grammar,
        masked_logprobs=masked_logprobs,
        keep_columns=keep_columns,
        prompt_token_ids=prompt_token_ids,
        format=format,
        resume=resume,
        overwrite=overwrite,
        quiet=quiet,
        window=window,
        dtype=dtype,
        device=device,
        revision=revision,
        engine=engine,
        num_shards=num_shards,
        shard_index=shard_index,
        ray=ray,
        ray_address=ray_address,
        replicas=replicas,
        threads_per_replica=threads_per_replica,
        cpus_per_replica=cpus_per_replica,
    )
    return run_generate(options)


def run_generate(opts: GenerateOptions) -> int:
    """The whole command; returns the exit code (raises CliError for usage problems)."""
    from cbrun.data.job import GenerateJob, JobProgress
    from cbrun.data.prompts import RowPreparer
    from cbrun.data.reader import InputError

    quiet_libraries(opts.quiet)
    check_input_output(opts)
    sampling = _sampling(opts)
    engine_config = build_engine_config(**opts.engine)
    keep = _keep_columns(opts.keep_columns)
    shard = _shard(opts)
    if opts.ray:
        return _run_ray(opts, sampling, keep, engine_config)
    target = OutputTarget.parse(opts.output, opts.input)
    source = _open_input(opts, keep)
    openai_input = _is_openai_input(source)
    fmt_name = _choose_format(opts.format, openai_input, target)
    target.check_existing(opts.resume, opts.overwrite)
    resume_state = _resume_state(target, fmt_name) if opts.resume else None

    with _claim_stdout(target.kind == "stdout") as data_stream:
        model, tokenizer = load_model(opts.model, opts.dtype, opts.device, opts.revision)
        if opts.chat and not getattr(tokenizer, "chat_template", None):
            raise CliError(f"--chat: the tokenizer of {opts.model!r} has no chat template")
        fmt, converter = _formats(fmt_name, openai_input, tokenizer, opts, keep)
        engine = _start_engine(model, tokenizer, engine_config)
        try:
            preparer = RowPreparer(
                tokenizer,
                sampling,
                max_context=engine.max_context,
                vocab_size=engine.vocab_size,
                prompt_column=opts.prompt_column,
                chat=opts.chat,
                keep_columns=keep,
            )
            writer = target.open_writer(fmt, data_stream, append=opts.resume)
            progress = JobProgress(rows_total=source.total if shard is None else None)  # a shard's size is unknown
            rows = source if shard is None else _select_rows(source, shard)
            job = GenerateJob(
                engine,
                rows,
                preparer,
                fmt,
                writer,
                openai=converter,
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
                except BrokenPipeError:  # `cbrun generate ... - | head`: the reader has enough
                    raise CliError("stopped: the reader of stdout closed the pipe", EXIT_ROWS_FAILED) from None
                finally:
                    with contextlib.suppress(BrokenPipeError):
                        writer.close()
        finally:
            engine.destroy()
    return _report(progress, dashboard, target, opts, shard)


# --- checks before any work -------------------------------------------------------


@dataclass
class OutputTarget:
    """Where results go: kind is "stdout", "jsonl" or "parquet"."""

    kind: str
    path: Path | None

    @classmethod
    def parse(cls, spec: str, input_spec: str | None) -> OutputTarget:
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


def _shard(opts: GenerateOptions):
    """This process's shard (None when not sharded); rewrites opts.output to the shard's own output."""
    from cbrun.scale.shards import ShardError, resolve_shard, shard_output

    try:
        shard = resolve_shard(opts.num_shards, opts.shard_index)
        if shard is None:
            return None
        if opts.ray:
            raise ShardError(
                f"--ray runs the whole input; this process was given shard {shard.describe()} "
                "(unset the scheduler's variables or drop --num-shards)"
            )
        output, in_directory = shard_output(opts.output, shard)
    except ShardError as exc:
        raise CliError(str(exc)) from None
    if in_directory:
        directory = Path(output).parent
        if not directory.parent.is_dir():
            raise CliError(f"output directory does not exist: {directory.parent}")
        directory.mkdir(exist_ok=True)  # every shard may be first: exist_ok
    opts.output = output
    return shard


def _run_ray(opts: GenerateOptions, sampling, keep: tuple[str, ...], engine_config) -> int:
    """`--ray`: the same checks and output columns, on --replicas Ray actors (see cbrun.scale.ray_job)."""
    from dataclasses import asdict

    from cbrun.scale.ray_job import (
        ProgressLines,
        RayJobError,
        RayProgress,
        default_cpus,
        run_ray_job,
        start_ray,
        summary,
    )

    if opts.resume:
        raise CliError(
            "--resume does not work with --ray yet; write to a new OUTPUT, or shard the job instead "
            "(--num-shards), which resumes per shard"
        )
    if opts.format == OutputFormat.openai:
        raise CliError("--format openai does not work with --ray (it writes cbrun rows)")
    if opts.replicas < 1 or opts.threads_per_replica < 1:
        raise CliError("--replicas and --threads-per-replica must be at least 1")
    if opts.cpus_per_replica is not None and opts.cpus_per_replica <= 0:
        raise CliError(f"--cpus-per-replica must be > 0, got {opts.cpus_per_replica}")
    target = OutputTarget.parse(opts.output, opts.input)
    target.check_existing(False, opts.overwrite)
    source = _open_input(opts, keep)
    if _is_openai_input(source):
        raise CliError("OpenAI Batch API input does not work with --ray; run it without --ray")
    fmt = _formats("cbrun", False, None, opts, keep)[0]
    generator = dict(
        model=opts.model,
        sampling={k: v for k, v in asdict(sampling).items() if k != "top_logprobs"},
        engine=asdict(engine_config),
        dtype=opts.dtype.value,
        device=opts.device.value,
        logprobs=opts.logprobs,
        top_logprobs=opts.top_logprobs,
        prompt_token_ids=opts.prompt_token_ids,
        keep_columns=keep,
        prompt_column=opts.prompt_column,
        chat=opts.chat,
        revision=opts.revision,
    )
    cpus = opts.cpus_per_replica or default_cpus(opts.threads_per_replica, opts.replicas, opts.ray_address is None)
    progress = RayProgress()
    with _claim_stdout(target.kind == "stdout") as data_stream:
        write_block, close = _ray_output(target, fmt, data_stream)
        try:
            start_ray(opts.ray_address, opts.threads_per_replica, opts.quiet)
            with contextlib.nullcontext() if opts.quiet else ProgressLines(progress):
                run_ray_job(
                    source,
                    write_block,
                    progress,
                    generator=generator,
                    replicas=opts.replicas,
                    threads=opts.threads_per_replica,
                    cpus_per_replica=cpus,
                    window=opts.window,
                )
        except RayJobError as exc:
            raise CliError(f"{exc}; the part files written so far are kept", EXIT_ROWS_FAILED) from None
        finally:
            close()
    where = "stdout" if target.path is None else str(target.path)
    if not opts.quiet:
        for line in summary(progress, where):
            print(line, file=sys.stderr)
    if progress.rows_failed:
        print(
            f"{progress.rows_failed} of {progress.rows_done} rows failed (see the error column of {where})",
            file=sys.stderr,
        )
        return EXIT_ROWS_FAILED
    return EXIT_OK


def _ray_output(target: OutputTarget, fmt, data_stream):
    """(write a result table, close): Parquet OUTPUT is a directory of part files, JSON Lines one file."""
    from cbrun.data.writers import ParquetParts

    if target.kind == "parquet":
        if target.path.is_dir():  # check_existing refused it unless --overwrite: drop the old parts only
            for old in target.path.glob("part-*.parquet*"):
                old.unlink()
        elif target.path.exists():
            target.path.unlink()
        parts = ParquetParts(target.path)
        return parts.write_table, parts.close
    writer = target.open_writer(fmt, data_stream, append=False)

    def write(table) -> None:
        for row in table.to_pylist():
            writer.write(row)
        writer.flush()

    return write, writer.close


def _select_rows(source, shard):
    from cbrun.scale.shards import select_rows

    return select_rows(source, shard)


def _sampling(opts: GenerateOptions):
    from cbrun.data.constraints import job_constraint
    from cbrun.engine import ConfigError, SamplingParams

    values = dict(
        max_tokens=opts.max_tokens,
        min_tokens=opts.min_tokens,
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        min_p=opts.min_p,
        seed=opts.seed,
        n=opts.n,
        stop=tuple(opts.stop),
        ignore_eos=opts.ignore_eos,
        top_logprobs=opts.top_logprobs,
        masked_logprobs=opts.masked_logprobs,
    )
    try:
        values["structured"] = job_constraint(
            json_schema_file=opts.json_schema, regex=opts.regex, choice=opts.choice or None, grammar_file=opts.grammar
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
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
    from cbrun.data.constraints import ROW_FIELDS
    from cbrun.data.prompts import ID_FIELDS, PROMPT_FIELDS, SAMPLING_OVERRIDES
    from cbrun.data.reader import InputError, open_input

    columns = {*ID_FIELDS, *PROMPT_FIELDS, *SAMPLING_OVERRIDES, *ROW_FIELDS, *keep, "method", "url", "body"}
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
    fmt = CbrunFormat(
        logprobs=opts.logprobs,
        top_logprobs=opts.top_logprobs > 0,
        prompt_token_ids=opts.prompt_token_ids,
        keep_columns=keep,
        structured=any((opts.json_schema, opts.regex, opts.choice, opts.grammar)),
    )
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

    dashboard = Dashboard(engine.stats, progress, stream=sys.stderr, title="cbrun generate")
    if hasattr(engine, "linear_kernels"):
        dashboard.notes.append(("linear kernels", engine.linear_kernels()))
    return dashboard


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


def _report(progress, dashboard, target: OutputTarget, opts: GenerateOptions, shard=None) -> int:
    where = "stdout" if target.path is None else str(target.path)
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
        extra = [("output", where if shard is None else str(target.path or "stdout"))]
        if shard is not None:
            extra.append(("shard", shard.describe()))
        dashboard.print_summary(extra)
        dashboard.note(line)
    return code
