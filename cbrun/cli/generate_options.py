"""`cbrun generate`'s own options (sampling, structured outputs, output columns, scale), declared once.

`GenerateOptions` is the whole command line: these bundles plus the shared ones
of `cbrun.cli.options` (see there for how typer reads a bundle).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, Optional

from cbrun.cli.choices import FormatName
from cbrun.cli.options import JobOptions, output_option, panel_option

SAMPLING_PANEL = "Sampling (rows may override)"
STRUCTURED_PANEL = "Structured outputs (a row's json_schema/regex/choice/grammar/json_object overrides)"
SCALE_PANEL = "Past one machine (shards, Ray)"

_sampling_option, _structured_option = panel_option(SAMPLING_PANEL), panel_option(STRUCTURED_PANEL)
_scale_option = functools.partial(panel_option(SCALE_PANEL), show_default=False)


@dataclass
class SamplingOptions:
    """The job's sampling parameters; a row may override each (see cbrun.data.prompts)."""

    max_tokens: Annotated[int, _sampling_option(help="Tokens to generate at most.")] = 256
    min_tokens: Annotated[
        int, _sampling_option(help="Tokens generated before EOS, a stop id or a stop string may end a row.")
    ] = 0
    temperature: Annotated[float, _sampling_option(help="0 is greedy.")] = 1.0
    top_p: Annotated[Optional[float], _sampling_option(help="Nucleus sampling (default off: 1.0).")] = None
    top_k: Annotated[Optional[int], _sampling_option(help="Top-k sampling (default off: 0).")] = None
    min_p: Annotated[Optional[float], _sampling_option(help="Min-p sampling (default off: 0).")] = None
    seed: Annotated[Optional[int], _sampling_option(help="Seed: same seed, same samples, whatever the batch.")] = None
    n: Annotated[int, _sampling_option("--n", help="Samples per prompt.")] = 1
    stop: Annotated[Optional[list[str]], _sampling_option(help="Stop string (repeatable).")] = None
    ignore_eos: Annotated[bool, _sampling_option("--ignore-eos", help="Do not stop at end-of-sequence tokens.")] = False


@dataclass
class GenerateOutputOptions:
    """The columns and format only generated rows have."""

    logprobs: Annotated[bool, output_option("--logprobs", help="Add the logprobs column (one per token).")] = False
    prompt_token_ids: Annotated[bool, output_option("--prompt-token-ids", help="Add the prompt_token_ids column.")] = (
        False
    )
    format: Annotated[
        FormatName,
        output_option(help="auto: OpenAI Batch output for OpenAI Batch input (JSON Lines), else cbrun rows."),
    ] = FormatName.auto


@dataclass
class StructuredOptions:
    """Job-wide structured-output constraints (files for the schema and the grammar)."""

    json_schema: Annotated[
        Optional[str],
        _structured_option(
            "--json-schema", metavar="FILE", help="Every output is JSON valid against this JSON schema file."
        ),
    ] = None
    regex: Annotated[Optional[str], _structured_option(help="Every output matches this regular expression.")] = None
    choice: Annotated[
        Optional[list[str]], _structured_option(help="Every output is one of these strings (repeatable).")
    ] = None
    grammar: Annotated[
        Optional[str],
        _structured_option(metavar="FILE", help="Every output follows this grammar (Lark or GBNF/EBNF text file)."),
    ] = None
    masked_logprobs: Annotated[
        bool,
        _structured_option(
            "--masked-logprobs",
            help="Constrained rows (and rows under --min-tokens) report logprobs of the masked "
            "distribution they were sampled from (default: the model's, before the mask).",
        ),
    ] = False


@dataclass
class ScaleOptions:
    """Past one process: a shard of the input (cbrun.scale.shards), or Ray actors (cbrun.scale.ray_job)."""

    num_shards: Annotated[
        Optional[int],
        _scale_option(
            help="Split the input into N shards by a stable hash of each row's id; this process runs one. "
            "Default: SLURM_ARRAY_TASK_COUNT, CBRUN_NUM_SHARDS (with JOB_COMPLETION_INDEX) or WORLD_SIZE. "
            "Sharded, OUTPUT out.parquet becomes the directory out.parquet/ of part-IIIII-of-NNNNN.parquet "
            "files, unless OUTPUT names one file per shard with {shard} (e.g. out-{shard}.jsonl)."
        ),
    ] = None
    shard_index: Annotated[
        Optional[int],
        _scale_option(
            help="The shard this process runs, 0..N-1. Default: SLURM_ARRAY_TASK_ID (minus SLURM_ARRAY_TASK_MIN), "
            "JOB_COMPLETION_INDEX or RANK."
        ),
    ] = None
    ray: Annotated[
        bool,
        _scale_option(
            "--ray",
            help="Run on Ray (pip install 'cbrun\\[ray]'): Ray workers read INPUT, --replicas engine actors "
            "write OUTPUT as a directory of part files (Parquet or JSON Lines, by its suffix), each with a "
            "manifest, so --resume finishes a killed job; row order is not kept.",
        ),
    ] = False
    ray_address: Annotated[
        Optional[str],
        _scale_option(
            help="Ray cluster to join (auto, or the head's host:port); default: $RAY_ADDRESS if set, else start "
            "a new local one.",
        ),
    ] = None
    ray_runtime_env: Annotated[
        Optional[str],
        _scale_option(
            metavar="JSON|FILE",
            help="With --ray: Ray runtime_env for the workers, as JSON or a .json/.yaml file "
            '(e.g. \'{"pip": ["cbrun"]}\' or py_modules for a source checkout).',
        ),
    ] = None
    replicas: Annotated[
        int, _scale_option(help="With --ray: engine actors, one model copy each.", show_default=True)
    ] = 2
    threads_per_replica: Annotated[
        int, _scale_option(help="With --ray: CPU threads of each engine.", show_default=True)
    ] = 1
    cpus_per_replica: Annotated[
        Optional[float],
        _scale_option(
            help="With --ray: CPUs Ray reserves per actor; fractions let actors share cores "
            "(default: threads-per-replica, lowered to fit a local machine's cores)."
        ),
    ] = None


@dataclass
class GenerateOptions(ScaleOptions, StructuredOptions, GenerateOutputOptions, SamplingOptions, JobOptions):
    """The `cbrun generate` command line, as values (bases last-first: typer shows them in field order)."""
