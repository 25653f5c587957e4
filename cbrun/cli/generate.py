"""`cbrun generate INPUT OUTPUT`: check the options, wire reader -> job -> writer, report.

Everything that can be refused (options, input, output, resume state, model)
is checked before any generation starts, and refused with one line and exit
code 2. The options are declared in `cbrun.cli.generate_options`; OUTPUT is
`cbrun.cli.output_target`; running the job is `cbrun.cli.run`; `--ray` is
`cbrun.cli.ray_run`. The logic itself lives in `cbrun.data` (job, readers,
writers, resume) and `cbrun.dashboard`. `generate(options)` is the command
(its docstring is its --help); it returns the exit code and raises CliError
for usage problems.
"""

from __future__ import annotations

from pathlib import Path

from cbrun.cli.common import CliError, check_input_output, keep_columns, open_rows, quiet_libraries
from cbrun.cli.generate_options import GenerateOptions, OutputFormat
from cbrun.cli.output_target import OutputTarget
from cbrun.cli.run import JobParts, preparer_args, run_local_job


def generate(opts: GenerateOptions) -> int:
    """Run a prompt dataset through the engine; write one row per (prompt, sample) as results finish.

    INPUT rows hold a prompt (text, chat messages or token ids), or are OpenAI Batch API request lines.
    """
    from cbrun.data.openai_batch import OpenAIFormat
    from cbrun.data.prompts import RowPreparer
    from cbrun.data.schema import BASE_COLUMNS, CbrunFormat

    quiet_libraries(opts.quiet)
    check_input_output(opts)
    sampling = _sampling(opts)
    engine_config = opts.engine_config()
    keep = keep_columns(opts.keep_columns, BASE_COLUMNS)
    shard = _shard(opts)
    if opts.ray:  # Ray workers read INPUT and write OUTPUT: nothing is opened here
        from cbrun.cli.ray_run import check_ray_options, run_ray

        check_ray_options(opts)
        return run_ray(opts, _cbrun_format(opts, keep), sampling, engine_config, keep, _prompt_columns(opts, keep))
    target = OutputTarget.parse(opts.output, opts.input)
    source = _open_prompts(opts, keep)
    openai_input = _is_openai_input(source)
    fmt_name = _choose_format(opts.format, openai_input, target)
    target.check_existing(opts.resume, opts.overwrite)
    classify = OpenAIFormat.classify if fmt_name == "openai" else CbrunFormat.classify
    resume_state = target.resume_state(classify) if opts.resume else None

    def parts(tokenizer, engine) -> JobParts:
        converter = OpenAIFormat(tokenizer, opts.model) if openai_input else None
        preparer = RowPreparer(tokenizer, sampling, **preparer_args(opts, engine, keep))
        fmt = converter if fmt_name == "openai" else _cbrun_format(opts, keep)
        return JobParts(preparer, fmt, openai=converter)

    rows = source if shard is None else _select_rows(source, shard)
    rows_total = source.total if shard is None else None  # a shard's size is unknown
    return run_local_job(opts, target, engine_config, rows, rows_total, resume_state, parts, "cbrun generate", shard)


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


def _select_rows(source, shard):
    from cbrun.scale.shards import select_rows

    return select_rows(source, shard)


def _sampling(opts: GenerateOptions):
    """The job's SamplingParams (structured-output constraint included); bad values are usage errors."""
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
        stop=tuple(opts.stop or ()),
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


def _open_prompts(opts: GenerateOptions, keep: tuple[str, ...]):
    """INPUT, reading the columns a prompt row or an OpenAI Batch request line may use."""
    return open_rows(opts, _prompt_columns(opts, keep))


def _prompt_columns(opts: GenerateOptions, keep: tuple[str, ...]) -> set[str]:
    """The columns worth reading from a columnar INPUT: ids, prompts, row overrides, kept columns, OpenAI fields."""
    from cbrun.data.constraints import ROW_FIELDS
    from cbrun.data.prompts import ID_FIELDS, PROMPT_FIELDS, SAMPLING_OVERRIDES

    columns = {*ID_FIELDS, *PROMPT_FIELDS, *SAMPLING_OVERRIDES, *ROW_FIELDS, *keep, "method", "url", "body"}
    return columns | ({opts.prompt_column} if opts.prompt_column else set())


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


def _cbrun_format(opts: GenerateOptions, keep: tuple[str, ...]):
    """cbrun rows with the columns the options ask for."""
    from cbrun.data.schema import CbrunFormat

    return CbrunFormat(
        logprobs=opts.logprobs,
        top_logprobs=opts.top_logprobs > 0,
        prompt_token_ids=opts.prompt_token_ids,
        keep_columns=keep,
        structured=any((opts.json_schema, opts.regex, opts.choice, opts.grammar)),
    )
