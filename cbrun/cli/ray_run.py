"""`cbrun generate --ray`: the same checks and output columns, on --replicas Ray actors (see cbrun.scale.ray_job).

`generate` checks the options and hands over here before INPUT is opened: Ray
workers read INPUT and write OUTPUT, a directory of part files (Parquet or JSON
Lines, by OUTPUT's suffix), and this process only plans, counts and reports.
Refusals (options, INPUT, OUTPUT) come before Ray starts; OpenAI Batch input is
refused once Ray has read its first row.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbrun.cli.choices import FormatName
from cbrun.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_ROWS_FAILED, CliError
from cbrun.cli.generate_options import GenerateOptions
from cbrun.cli.output_target import OutputTarget

if TYPE_CHECKING:
    from cbrun.data.generate.format import CbrunFormat
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams


def check_ray_options(opts: GenerateOptions) -> None:
    """What --ray refuses, checked before INPUT is opened."""
    if opts.format == FormatName.openai:
        raise CliError("--format openai does not work with --ray (it writes cbrun rows)")
    if opts.output == "-":
        raise CliError("--ray writes OUTPUT as part files from the workers: give a .parquet or .jsonl path, not -")
    if opts.replicas < 1 or opts.threads_per_replica < 1:
        raise CliError("--replicas and --threads-per-replica must be at least 1")
    if opts.cpus_per_replica is not None and opts.cpus_per_replica <= 0:
        raise CliError(f"--cpus-per-replica must be > 0, got {opts.cpus_per_replica}")
    if opts.ray_runtime_env is not None:
        runtime_env(opts.ray_runtime_env)


def runtime_env(text: str | None) -> dict | None:
    """--ray-runtime-env: a JSON object, or a .json / .yaml file holding one."""
    if text is None:
        return None
    path = Path(text)
    try:
        if path.suffix.lower() in (".json", ".yaml", ".yml") and path.is_file():
            raw = path.read_text()
            value = json.loads(raw) if path.suffix.lower() == ".json" else _yaml(raw)
        else:
            value = json.loads(text)
    except (OSError, ValueError) as exc:
        raise CliError(f"--ray-runtime-env: not a JSON object or a readable .json/.yaml file: {exc}") from None
    if not isinstance(value, dict):
        raise CliError('--ray-runtime-env must be a JSON object, e.g. \'{"pip": ["cbrun"]}\'')
    return value


def _yaml(text: str) -> Any:
    import yaml  # type: ignore[import-untyped]  # Ray depends on PyYAML

    return yaml.safe_load(text)


def run_ray(
    opts: GenerateOptions,
    fmt: CbrunFormat,
    sampling: SamplingParams,
    engine_config: EngineConfig,
    keep: tuple[str, ...],
    columns: set[str],
) -> int:
    """Run the job on Ray actors; returns the exit code (a failed or interrupted job keeps its parts)."""
    from cbrun.data.generate.openai_batch import looks_like_openai_batch
    from cbrun.data.reader import InputError
    from cbrun.scale import ray_job
    from cbrun.scale.input_plan import plan_input
    from cbrun.scale.output_dir import OutputError, check_output
    from cbrun.scale.part_store import PartStore

    assert opts.output is not None  # check_input_output refused a missing OUTPUT
    target = OutputTarget.parse(opts.output, opts.input)
    assert target.path is not None and target.kind in ("parquet", "jsonl")  # check_ray_options refused stdout
    store = PartStore(target.path, target.kind, run=uuid.uuid4().hex)
    parallelism = opts.replicas * ray_job.UNITS_PER_REPLICA
    address = opts.ray_address or os.environ.get("RAY_ADDRESS") or None  # as `ray job submit` sets it
    try:
        plan = plan_input(opts.input, dataset=opts.dataset, split=opts.split, columns=columns, parallelism=parallelism)
        check_output(store, resume=opts.resume, overwrite=opts.overwrite)
    except (InputError, OutputError) as exc:
        raise CliError(str(exc)) from None
    progress = ray_job.RayProgress()
    try:
        ray_job.start_ray(address, opts.threads_per_replica, opts.quiet, runtime_env(opts.ray_runtime_env))
        if looks_like_openai_batch(ray_job.first_input_record(plan)):
            raise CliError("OpenAI Batch API input does not work with --ray; run it without --ray")
        generator = generator_args(opts, sampling, engine_config, keep, structured=fmt.structured)
        cpus = opts.cpus_per_replica or ray_job.default_cpus(opts.threads_per_replica, opts.replicas, address is None)
        job = ray_job.RayJob(
            plan=plan,
            store=store,
            fmt=fmt,
            generator=generator,
            replicas=opts.replicas,
            threads=opts.threads_per_replica,
            cpus_per_replica=cpus,
            window=opts.window,
        )
        ray_job.run_to_output(job, progress, resume=opts.resume, overwrite=opts.overwrite, view=not opts.quiet)
    except (InputError, OutputError) as exc:
        raise CliError(str(exc)) from None
    except ray_job.RayJobError as exc:
        raise CliError(
            f"{exc}; the part files written so far are kept (--resume finishes the job)", EXIT_ROWS_FAILED
        ) from None
    except KeyboardInterrupt:
        print(
            f"interrupted: {progress.rows_done:,} rows are in {store.root}; --resume finishes the job", file=sys.stderr
        )
        return EXIT_INTERRUPTED
    return _report(opts, progress, str(store.root))


def _report(opts: GenerateOptions, progress: Any, where: str) -> int:
    """The summary lines and the exit code: failed rows and duplicate ids are exit code 1."""
    from cbrun.scale.ray_job import summary

    if not opts.quiet:
        for line in summary(progress, where):
            print(line, file=sys.stderr)
    code = EXIT_OK
    if progress.missing_rows or progress.doubled_rows:
        print(
            f"OUTPUT check failed: {progress.missing_rows:,} input rows missing, {progress.doubled_rows:,} written "
            "twice (--resume runs the missing ones)",
            file=sys.stderr,
        )
        code = EXIT_ROWS_FAILED
    if progress.duplicates is not None and progress.duplicates.count:
        print(f"{progress.duplicates.describe()}; every row was written, under the same id", file=sys.stderr)
        code = EXIT_ROWS_FAILED
    if progress.rows_failed:
        print(
            f"{progress.rows_failed} of {progress.rows_done} rows failed (see the error column of {where})",
            file=sys.stderr,
        )
        code = EXIT_ROWS_FAILED
    return code


def generator_args(
    opts: GenerateOptions,
    sampling: SamplingParams,
    engine_config: EngineConfig,
    keep: tuple[str, ...],
    *,
    structured: bool,
) -> dict:
    """The keyword arguments of each actor's `CbrunGenerator`: the job's model, sampling, engine and columns.

    structured: every row gets the structured column (a job-wide constraint).
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
