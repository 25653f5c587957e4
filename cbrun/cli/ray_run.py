"""`cbrun generate --ray`: the same checks and output columns, on --replicas Ray actors (see cbrun.scale.ray_job).

`generate` opens INPUT and builds the output format as for a local run, then
hands over here; rows are written as the actors' batches finish, so a Parquet
OUTPUT is a directory of part files.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict, fields
from typing import TYPE_CHECKING

from cbrun.cli.choices import FormatName
from cbrun.cli.common import EXIT_OK, EXIT_ROWS_FAILED, CliError
from cbrun.cli.generate_options import GenerateOptions
from cbrun.cli.output_target import OutputTarget
from cbrun.cli.run import claim_stdout

if TYPE_CHECKING:
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams


def check_ray_options(opts: GenerateOptions) -> None:
    """What --ray refuses, checked before INPUT is opened."""
    if opts.resume:
        raise CliError(
            "--resume does not work with --ray yet; write to a new OUTPUT, or shard the job instead "
            "(--num-shards), which resumes per shard"
        )
    if opts.format == FormatName.openai:
        raise CliError("--format openai does not work with --ray (it writes cbrun rows)")
    if opts.replicas < 1 or opts.threads_per_replica < 1:
        raise CliError("--replicas and --threads-per-replica must be at least 1")
    if opts.cpus_per_replica is not None and opts.cpus_per_replica <= 0:
        raise CliError(f"--cpus-per-replica must be > 0, got {opts.cpus_per_replica}")


def run_ray(opts: GenerateOptions, target: OutputTarget, source, fmt, sampling, engine_config, keep) -> int:
    """Run the job on Ray actors; returns the exit code (a failed Ray job keeps the part files written)."""
    from cbrun.scale.ray_job import (
        ProgressLines,
        RayJobError,
        RayProgress,
        default_cpus,
        rows_carry_constraints,
        run_ray_job,
        start_ray,
        summary,
    )

    target.check_existing(False, opts.overwrite)
    rows = list(source)  # the whole input goes to Ray's object store before the job starts
    structured = fmt.structured or rows_carry_constraints(rows)
    generator = generator_args(opts, sampling, engine_config, keep, structured=structured)
    cpus = opts.cpus_per_replica or default_cpus(opts.threads_per_replica, opts.replicas, opts.ray_address is None)
    progress = RayProgress()
    with claim_stdout(target.kind == "stdout") as data_stream:
        write_block, close = _ray_output(target, fmt, data_stream)
        try:
            start_ray(opts.ray_address, opts.threads_per_replica, opts.quiet)
            with contextlib.nullcontext() if opts.quiet else ProgressLines(progress):
                run_ray_job(
                    rows,
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
    if not opts.quiet:
        for line in summary(progress, target.where):
            print(line, file=sys.stderr)
    if progress.rows_failed:
        print(
            f"{progress.rows_failed} of {progress.rows_done} rows failed (see the error column of {target.where})",
            file=sys.stderr,
        )
        return EXIT_ROWS_FAILED
    return EXIT_OK


def generator_args(
    opts: GenerateOptions,
    sampling: SamplingParams,
    engine_config: EngineConfig,
    keep: tuple[str, ...],
    *,
    structured: bool,
) -> dict:
    """The keyword arguments of each actor's `CbrunGenerator`: the job's model, sampling, engine and columns.

    structured: every row gets the structured column (a job-wide constraint, or rows with their own).
    """
    return dict(
        model=opts.model,
        # fields as they are: asdict would turn a job-wide StructuredSpec into a dict SamplingParams refuses
        sampling={f.name: getattr(sampling, f.name) for f in fields(sampling) if f.name != "top_logprobs"},
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
        structured=structured,
    )


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
