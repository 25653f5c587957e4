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

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbrun.cli.choices import FormatName
from cbrun.cli.common import CliError, keep_columns, quiet_libraries
from cbrun.cli.generate_options import GenerateOptions
from cbrun.cli.output_target import OutputTarget
from cbrun.cli.run import JobPlan, ModelChoice, run_local_job

if TYPE_CHECKING:
    from cbrun.data.generate.format import CbrunFormat
    from cbrun.data.reader import InputSource, RawRow
    from cbrun.engine.sampling_params import SamplingParams
    from cbrun.scale.shards import Shard


def generate(opts: GenerateOptions) -> int:
    """Run a prompt dataset through the engine; write one row per (prompt, sample) as results finish.

    INPUT rows hold a prompt (text, chat messages or token ids), or are OpenAI Batch API request lines.
    """
    from cbrun.data.generate.format import GENERATE_COLUMNS, CbrunFormat
    from cbrun.data.generate.openai_batch import OpenAIFormat
    from cbrun.data.generate.parts import GenerateParts

    quiet_libraries(opts.quiet)
    output = opts.check_paths()
    sampling = _sampling(opts)
    engine_config = opts.engine_config()
    keep = keep_columns(opts.keep_columns, GENERATE_COLUMNS)
    shard, output = _shard(opts, output)
    if opts.ray:  # Ray workers read INPUT and write OUTPUT: nothing is opened here
        from cbrun.cli.ray_run import check_ray_options, run_ray

        check_ray_options(opts)
        return run_ray(opts, _cbrun_format(opts, keep), sampling, engine_config, keep, _prompt_columns(opts, keep))
    target = OutputTarget.parse(output, opts.input)
    source = _open_prompts(opts, keep)
    openai_input = _is_openai_input(source)
    fmt_name = _choose_format(opts.format, openai_input, target)
    target.check_existing(opts.resume, opts.overwrite)
    classify = OpenAIFormat.classify if fmt_name == "openai" else CbrunFormat.classify
    resume_state = target.resume_state(classify) if opts.resume else None

    parts = GenerateParts(
        sampling,
        _cbrun_format(opts, keep),
        openai_input=openai_input,
        openai_output=fmt_name == "openai",
        model_name=opts.model,
        prompt_column=opts.prompt_column,
        chat=opts.chat,
        keep_columns=keep,
    )
    plan = JobPlan(
        title="cbrun generate",
        model=ModelChoice(opts.model, opts.dtype, opts.device, opts.revision),
        engine_config=engine_config,
        target=target,
        rows=source if shard is None else _select_rows(source, shard),
        rows_total=source.total if shard is None else None,  # a shard's size is unknown
        resume=resume_state,
        parts=parts,
        window=opts.window,
        quiet=opts.quiet,
        shard=shard,
    )
    return run_local_job(plan)


def _shard(opts: GenerateOptions, output: str) -> tuple[Shard | None, str]:
    """This process's shard (None when not sharded) and its own OUTPUT (`output` when not sharded)."""
    from cbrun.scale.shards import ShardError, resolve_shard, shard_output

    try:
        shard = resolve_shard(opts.num_shards, opts.shard_index)
        if shard is None:
            return None, output
        if opts.ray:
            raise ShardError(
                f"--ray runs the whole input; this process was given shard {shard.describe()} "
                "(unset the scheduler's variables or drop --num-shards)"
            )
        output, in_directory = shard_output(output, shard)
    except ShardError as exc:
        raise CliError(str(exc)) from None
    if in_directory:
        directory = Path(output).parent
        if not directory.parent.is_dir():
            raise CliError(f"output directory does not exist: {directory.parent}")
        directory.mkdir(exist_ok=True)  # every shard may be first: exist_ok
    return shard, output


def _select_rows(source: InputSource, shard: Shard) -> Iterator[RawRow]:
    from cbrun.scale.shards import select_rows

    return select_rows(source, shard)


def _sampling(opts: GenerateOptions) -> SamplingParams:
    """The job's SamplingParams (structured-output constraint included); bad values are usage errors."""
    from cbrun.data.constraints import job_constraint
    from cbrun.engine import ConfigError, SamplingParams

    values: dict[str, Any] = dict(
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


def _open_prompts(opts: GenerateOptions, keep: tuple[str, ...]) -> InputSource:
    """INPUT, reading the columns a prompt row or an OpenAI Batch request line may use."""
    return opts.open_rows(_prompt_columns(opts, keep))


def _prompt_columns(opts: GenerateOptions, keep: tuple[str, ...]) -> set[str]:
    """The columns worth reading from a columnar INPUT: ids, prompts, row overrides, kept columns, OpenAI fields."""
    from cbrun.data.constraints import ROW_FIELDS
    from cbrun.data.generate.preparer import SAMPLING_OVERRIDES
    from cbrun.data.prompts import PROMPT_FIELDS
    from cbrun.data.rows import ID_FIELDS, LORA_FIELD

    columns = {*ID_FIELDS, *PROMPT_FIELDS, *SAMPLING_OVERRIDES, *ROW_FIELDS, *keep, LORA_FIELD, "method", "url", "body"}
    return columns | ({opts.prompt_column} if opts.prompt_column else set())


def _is_openai_input(source: InputSource) -> bool:
    from cbrun.data.generate.openai_batch import looks_like_openai_batch

    first = source.peek()
    return first is not None and looks_like_openai_batch(first.record)


def _choose_format(requested: FormatName, openai_input: bool, target: OutputTarget) -> str:
    if requested == FormatName.openai:
        if not openai_input:
            raise CliError("--format openai needs OpenAI Batch API input (lines with custom_id, url and body)")
        if target.kind == "parquet":
            raise CliError("--format openai writes JSON Lines; use a .jsonl OUTPUT or - ")
        return "openai"
    if requested == FormatName.auto and openai_input and target.kind != "parquet":
        return "openai"
    return "cbrun"


def _cbrun_format(opts: GenerateOptions, keep: tuple[str, ...]) -> CbrunFormat:
    """cbrun rows with the columns the options ask for."""
    from cbrun.data.generate.format import CbrunFormat

    return CbrunFormat(
        logprobs=opts.logprobs,
        top_logprobs=opts.top_logprobs > 0,
        prompt_token_ids=opts.prompt_token_ids,
        keep_columns=keep,
        structured=any((opts.json_schema, opts.regex, opts.choice, opts.grammar)),
    )
