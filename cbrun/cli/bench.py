"""`cbrun bench`: throughput of cbrun and its peers on one synthetic or dataset workload.

Thin: parse the options, load the model, build the workload, hand over to
`cbrun.bench.runner`, print and save the report. Flag names follow
`vllm bench throughput` and `cbrun generate`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

ENGINE_HELP = "Comma-separated engines to run, one after another: cbrun, transformers, hf-static, vllm."


def bench(
    model: Annotated[str, typer.Option(help="HF model dir, cached hub id, .gguf file, or alias.")] = "smollm2-135m",
    engine: Annotated[str, typer.Option(help=ENGINE_HELP)] = "cbrun",
    num_prompts: Annotated[Optional[int], typer.Option(help="Prompts (default 256; with --dataset-path: every row).")] = None,
    input_len: Annotated[int, typer.Option(help="Mean random prompt length in tokens (after any prefix).")] = 256,
    output_len: Annotated[int, typer.Option(help="Mean output length in tokens (max tokens per request).")] = 128,
    random_range_ratio: Annotated[float, typer.Option(help="Lengths uniform in [L(1-r), L(1+r)].")] = 0.0,
    prefix_len: Annotated[int, typer.Option(help="Shared prefix tokens before each random prompt.")] = 0,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the workload and of sampling.")] = 0,
    dataset_path: Annotated[Optional[Path], typer.Option(help="cbrun input JSONL (prompt / messages / input_ids) instead of random prompts.")] = None,
    ignore_eos: Annotated[Optional[bool], typer.Option("--ignore-eos/--no-ignore-eos", help="Generate exactly the output length (default: on for random prompts, off for a dataset).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 1.0,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    static_batch_size: Annotated[int, typer.Option(help="Batch size of the hf-static peer.")] = 32,
    vllm_python: Annotated[Optional[str], typer.Option(help="Python interpreter of an environment with vLLM.")] = None,
    transformers_cb_config: Annotated[Optional[str], typer.Option(help="JSON overrides of transformers' ContinuousBatchingConfig (default: its defaults).")] = None,
    output_json: Annotated[Optional[Path], typer.Option(help="Write the report as JSON here.")] = None,
    page_size: Annotated[Optional[int], typer.Option(help="KV cache page size in tokens.")] = None,
    num_blocks: Annotated[Optional[int], typer.Option(help="KV cache pages (default: sized from memory).")] = None,
    max_batch_tokens: Annotated[Optional[int], typer.Option(help="Query tokens per forward pass.")] = None,
    max_requests_per_batch: Annotated[Optional[int], typer.Option(help="Sequences per forward pass.")] = None,
    scheduler: Annotated[str, typer.Option(help="fifo or prefill-first.")] = "fifo",
    safety_margin: Annotated[Optional[float], typer.Option(help="Free-cache fraction kept for running decodes.")] = None,
    no_prefix_cache: Annotated[bool, typer.Option("--no-prefix-cache", help="Disable prefix caching.")] = False,
    cpu_offload_gb: Annotated[float, typer.Option(help="CPU swap pool for preempted requests, GiB (0: recompute).")] = 0.0,
    max_memory_percent: Annotated[Optional[float], typer.Option(help="Share of available memory for the cache (0.5 or 50).")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda.")] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
) -> None:
    """Measure throughput of cbrun and peer engines on the same requests, side by side."""
    from cbrun.bench.peers import PEER_NAMES, PeerContext, Progress
    from cbrun.bench.report import print_report
    from cbrun.bench.runner import run_bench

    engines = [e.strip() for e in engine.split(",") if e.strip()]
    unknown = [e for e in engines if e not in PEER_NAMES]
    if not engines or unknown:
        raise typer.BadParameter(f"unknown engine(s) {unknown or engine!r}; choose from {', '.join(PEER_NAMES)}",
                                 param_hint="--engine")
    cb_overrides = _json_option(transformers_cb_config, "--transformers-cb-config")
    engine_config = _engine_config(page_size, num_blocks, max_batch_tokens, max_requests_per_batch, scheduler,
                                   safety_margin, no_prefix_cache, cpu_offload_gb, max_memory_percent)
    progress = Progress(quiet=quiet)
    model_obj, tokenizer, torch_dtype, device_name = _load(model, dtype, device, progress)

    workload, warmup, skipped = _workloads(
        model_obj, tokenizer, dataset_path, num_prompts, input_len, output_len, random_range_ratio, prefix_len,
        n, seed, ignore_eos, temperature)
    for row in skipped[:5]:
        progress.message(f"[bench] skipped dataset {row}")
    config = {
        "model": model, "engines": engines, "dtype": dtype, "dtype_resolved": str(torch_dtype).removeprefix("torch."),
        "device": device_name, "workload": workload.source, "num_prompts": workload.num_prompts,
        "input_len": input_len, "output_len": output_len, "random_range_ratio": random_range_ratio,
        "prefix_len": prefix_len, "n": n, "seed": seed, "ignore_eos": workload.ignore_eos,
        "temperature": temperature, "num_input_tokens": workload.num_input_tokens,
        "max_output_tokens": workload.max_output_tokens, "dataset_rows_skipped": len(skipped),
        "static_batch_size": static_batch_size, "vllm_python": vllm_python,
        "transformers_cb_config": cb_overrides or "defaults", "engine_config": _asdict(engine_config),
        "warmup_prompts": warmup.num_prompts,
    }
    ctx = PeerContext(
        model=model_obj, tokenizer=tokenizer, model_spec=model, dtype=torch_dtype, device=device_name,
        engine_config=engine_config, static_batch_size=static_batch_size, vllm_python=vllm_python,
        transformers_cb_config=cb_overrides, progress=progress, dashboard=_dashboard(quiet),
    )
    report = run_bench(engines, ctx, workload, warmup, config)
    print_report(report)
    if output_json is not None:
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if any(e["status"] == "failed" for e in report["results"]):
        raise typer.Exit(1)


def _json_option(text: str | None, name: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not valid JSON: {e}", param_hint=name) from e
    if not isinstance(value, dict):
        raise typer.BadParameter("must be a JSON object", param_hint=name)
    return value


def _engine_config(page_size, num_blocks, max_batch_tokens, max_requests_per_batch, scheduler, safety_margin,
                   no_prefix_cache, cpu_offload_gb, max_memory_percent):
    from cbrun.engine import ConfigError, EngineConfig

    if max_memory_percent is not None and max_memory_percent > 1:
        max_memory_percent /= 100.0
    given = dict(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                 max_requests_per_batch=max_requests_per_batch, safety_margin=safety_margin,
                 max_memory_percent=max_memory_percent)
    try:
        return EngineConfig(scheduler=scheduler, allow_block_sharing=not no_prefix_cache,
                            cpu_offload_space=cpu_offload_gb, **{k: v for k, v in given.items() if v is not None})
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from e


def _load(spec: str, dtype: str, device: str, progress):
    from cbrun.models import ModelLoadError, load_model

    progress.message(f"[bench] loading {spec}")
    try:
        model, tokenizer = load_model(spec, dtype=dtype, device=device)
    except (ModelLoadError, ValueError) as e:
        typer.echo(f"Error: {e}", err=True)
        raise typer.Exit(2) from e
    return model, tokenizer, model.dtype, str(model.device)


def _workloads(model, tokenizer, dataset_path, num_prompts, input_len, output_len, range_ratio, prefix_len, n,
               seed, ignore_eos, temperature):
    """The timed workload, its warm-up, and skipped dataset rows; bad values exit with a usage error."""
    from cbrun.bench.dataset import dataset_workload
    from cbrun.bench.workload import random_workload, usable_token_ids, warmup_workload

    try:
        text_config = model.config.get_text_config()
        vocab_size = text_config.vocab_size
        context = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        token_ids = usable_token_ids(tokenizer, vocab_size)
        skipped: list[str] = []
        if dataset_path is not None:
            workload, skipped = dataset_workload(
                dataset_path, tokenizer, output_len=output_len, max_context=context, vocab_size=vocab_size,
                num_prompts=num_prompts, n=n, ignore_eos=bool(ignore_eos), temperature=temperature, seed=seed)
        else:
            workload = random_workload(
                token_ids, num_prompts=256 if num_prompts is None else num_prompts, input_len=input_len,
                output_len=output_len, range_ratio=range_ratio, prefix_len=prefix_len, n=n,
                ignore_eos=True if ignore_eos is None else ignore_eos, temperature=temperature, seed=seed)
        if temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {temperature}")
        if workload.max_total_len > context:
            raise ValueError(f"the longest request needs {workload.max_total_len} tokens (prompt + output), "
                             f"more than the model's context of {context}")
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e)) from e
    return workload, warmup_workload(workload, token_ids), skipped


def _dashboard(quiet: bool):
    """The live engine view of `cbrun generate`, when that module is present (plain progress lines otherwise)."""
    if quiet:
        return None
    try:
        from cbrun.dashboard import bench_dashboard  # type: ignore[attr-defined]
    except ImportError:
        return None
    return bench_dashboard


def _asdict(config) -> dict:
    from dataclasses import asdict

    return asdict(config)
