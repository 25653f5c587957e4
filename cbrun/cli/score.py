"""`cbrun score INPUT OUTPUT`: teacher-forced logprobs of given completions, through generate's machinery.

Same options (model, input, output, engine), input readers, output writers,
`--resume`, dashboard, interrupts, exit codes and error rows as `cbrun
generate`; only the rows (see `cbrun.data.score`) and the engine requests
(scoring, not sampling) differ. Usage problems are refused with one line and
exit code 2 before the model loads. `score(options)` is the command (its
docstring is its --help); it returns the exit code and raises CliError for
usage problems.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from cbrun.cli.common import CliError, keep_columns, quiet_libraries
from cbrun.cli.options import JobOptions, output_option
from cbrun.cli.output_target import OutputTarget
from cbrun.cli.run import JobPlan, ModelChoice, run_local_job

if TYPE_CHECKING:
    from cbrun.data.reader import InputSource


@dataclass
class ScoreOutputOptions:
    prompt_logprobs: Annotated[
        bool,
        output_option(
            "--prompt-logprobs",
            help="Add prompt_logprobs (one per prompt token, the first null); computes every "
            "prompt position, so completions no longer share a cached prompt.",
        ),
    ] = False


@dataclass
class ScoreOptions(ScoreOutputOptions, JobOptions):
    """The `cbrun score` command line, as values (bases last-first: typer shows them in field order)."""


def score(opts: ScoreOptions) -> int:
    """Score given completions: per-token logprobs (temperature 1), their sum, and whether each was greedy.

    INPUT rows hold a prompt and the completions to score; `cbrun generate --prompt-token-ids` output works as is.
    """
    from cbrun.data.score.format import SCORE_COLUMNS, ScoreFormat
    from cbrun.data.score.parts import ScoreParts
    from cbrun.data.score.row_kind import ScoreRows

    quiet_libraries(opts.quiet)
    output = opts.check_paths()
    if opts.top_logprobs < 0:
        raise CliError(f"--top-logprobs must be >= 0, got {opts.top_logprobs}")
    engine_config = opts.engine_config()
    keep = keep_columns(opts.keep_columns, SCORE_COLUMNS)
    target = OutputTarget.parse(output, opts.input)
    source = _open_score_rows(opts, keep)
    fmt = ScoreFormat(top_logprobs=opts.top_logprobs > 0, prompt_logprobs=opts.prompt_logprobs, keep_columns=keep)
    target.check_existing(opts.resume, opts.overwrite)
    resume_state = target.resume_state(ScoreFormat.classify) if opts.resume else None
    kind = ScoreRows(prompt_logprobs=opts.prompt_logprobs, top_logprobs=opts.top_logprobs)
    plan = JobPlan(
        title="cbrun score",
        model=ModelChoice(opts.model, opts.dtype, opts.device, opts.revision),
        engine_config=engine_config,
        target=target,
        rows=source,
        rows_total=source.total,
        resume=resume_state,
        parts=ScoreParts(fmt, kind, prompt_column=opts.prompt_column, chat=opts.chat, keep_columns=keep),
        window=opts.window,
        quiet=opts.quiet,
    )
    return run_local_job(plan)


def _open_score_rows(opts: ScoreOptions, keep: tuple[str, ...]) -> InputSource:
    """INPUT, reading the columns a score row may use (generate's output rows among them)."""
    from cbrun.data.prompts import PROMPT_FIELDS
    from cbrun.data.rows import ID_FIELDS, LORA_FIELD
    from cbrun.data.score.preparer import COMPLETION_FIELDS, SCORE_PROMPT_IDS

    fields = {*ID_FIELDS, *PROMPT_FIELDS, *COMPLETION_FIELDS, SCORE_PROMPT_IDS, LORA_FIELD, "sample", "error", *keep}
    return opts.open_rows(fields)
