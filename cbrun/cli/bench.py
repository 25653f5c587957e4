"""`cbrun bench`: throughput of cbrun and its peers on one synthetic or dataset workload.

Thin: parse the options, load the model, build the workload, hand over to
`cbrun.bench.runner`, print and save the report. Flag names follow
`vllm bench throughput`; engine options are those of `cbrun generate`.
Usage problems raise CliError (one line, exit 2); a peer that crashed makes
the exit code 1 after the report is printed; an unavailable one does not.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from cbrun.bench.random_model import RandomModelError, is_random, random_model_dir
from cbrun.cli.bench_options import DEFAULT_NUM_PROMPTS, BenchOptions
from cbrun.cli.common import EXIT_OK, EXIT_ROWS_FAILED, CliError, load_model, quiet_libraries

if TYPE_CHECKING:
    from cbrun.bench.peers import Progress
    from cbrun.bench.workload import Workload
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.model_spec import CausalLM, Tokenizer


def bench(opts: BenchOptions) -> int:
    """Measure cbrun against peer engines on the same requests: one table, one run, one machine."""
    from cbrun.bench.peers import Progress
    from cbrun.bench.peers.registry import PEER_NAMES
    from cbrun.bench.report import print_report

    quiet_libraries(opts.quiet)
    engines = [e.strip() for e in opts.engine.split(",") if e.strip()]
    unknown = [e for e in engines if e not in PEER_NAMES]
    if not engines or unknown:
        raise CliError(
            f"--engine: unknown engine {', '.join(unknown) or repr(opts.engine)} (choose from {', '.join(PEER_NAMES)})"
        )
    if opts.threads is not None and opts.threads < 1:
        raise CliError(f"--threads must be at least 1, got {opts.threads}")
    if opts.vllm_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise CliError(f"--vllm-dtype must be auto, float32, bfloat16 or float16, got {opts.vllm_dtype!r}")
    if opts.static_batch_size < 1:
        raise CliError(f"--static-batch-size must be at least 1, got {opts.static_batch_size}")
    if opts.output_json is not None and not opts.output_json.parent.is_dir():
        raise CliError(f"--output-json: directory does not exist: {opts.output_json.parent}")
    cb_overrides = _cb_overrides(opts.transformers_cb_config)
    engine_config = opts.engine_config()
    if opts.threads is not None:
        import torch

        torch.set_num_threads(opts.threads)
    if opts.plot is not None:
        from cbrun.bench.plot import PlotError, check_target

        try:
            check_target(opts.plot)
        except PlotError as exc:
            raise CliError(str(exc)) from None
    progress = Progress(quiet=opts.quiet)
    specs = [m.strip() for m in opts.model.split(",") if m.strip()]
    if not specs:
        raise CliError("--model: no model named")
    reports = []
    for spec in specs:  # one model at a time: each freed before the next loads
        report = _bench_model(spec, opts, engines, progress, cb_overrides, engine_config)
        print_report(report)
        reports.append(report)
    if opts.output_json is not None:
        document = reports[0] if len(reports) == 1 else {"runs": reports}
        opts.output_json.write_text(json.dumps(document, indent=2, default=str) + "\n")
    if opts.plot is not None:
        from cbrun.bench.plot import plot as draw, plot_sizes

        if len(reports) == 1:
            draw(reports[0], opts.plot)
        else:
            plot_sizes(reports, opts.plot)
    failed = any(e["status"] == "failed" for report in reports for e in report["results"])
    return EXIT_ROWS_FAILED if failed else EXIT_OK


def _bench_model(
    spec: str,
    opts: BenchOptions,
    engines: list[str],
    progress: Progress,
    cb_overrides: dict,
    engine_config: EngineConfig,
) -> dict:
    """Load one model, run every engine on its workload, and return the report."""
    from cbrun.bench.peers import PeerContext
    from cbrun.bench.runner import run_bench

    model = spec
    if is_random(model):  # a real architecture at a real size, random weights, saved once for every engine
        progress.message(f"[bench] building {model} (once; cached)")
        try:
            model = str(random_model_dir(model))
        except RandomModelError as exc:
            raise CliError(str(exc)) from None
    progress.message(f"[bench] loading {model}")
    model_obj, tokenizer = load_model(model, opts.dtype, opts.device, opts.revision)

    workload, warmup, skipped = _workloads(model_obj, tokenizer, opts)
    if skipped:
        progress.message(f"[bench] {len(skipped)} dataset rows skipped, first: {skipped[0]}")
    config = {
        "model": model,
        "model_name": spec,
        "parameters": sum(p.numel() for p in model_obj.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model_obj.parameters()),
        "revision": opts.revision,
        "engines": engines,
        "dtype": opts.dtype.value,
        "dtype_resolved": str(model_obj.dtype).removeprefix("torch."),
        "device": str(model_obj.device),
        "workload": workload.source,
        "num_prompts": workload.num_prompts,
        "input_len": opts.input_len,
        "output_len": opts.output_len,
        "random_range_ratio": opts.random_range_ratio,
        "prefix_len": opts.prefix_len,
        "n": opts.n,
        "seed": opts.seed,
        "ignore_eos": workload.ignore_eos,
        "temperature": opts.temperature,
        "num_input_tokens": workload.num_input_tokens,
        "max_output_tokens": workload.max_output_tokens,
        "dataset_rows_skipped": len(skipped),
        "warmup_prompts": warmup.num_prompts,
        "threads": opts.threads,
        "static_batch_size": opts.static_batch_size,
        "vllm_python": opts.vllm_python,
        "vllm_dtype": opts.vllm_dtype,
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
        threads=opts.threads,
        static_batch_size=opts.static_batch_size,
        vllm_python=opts.vllm_python,
        vllm_dtype=opts.vllm_dtype,
        transformers_cb_config=cb_overrides,
        progress=progress,
        dashboard=None if opts.quiet else _dashboard(),
    )
    return run_bench(engines, ctx, workload, warmup, config)


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


def _workloads(model: CausalLM, tokenizer: Tokenizer, opts: BenchOptions) -> tuple[Workload, Workload, list[str]]:
    """The timed workload, its warm-up and the skipped dataset rows; bad values are usage errors."""
    from cbrun.bench.dataset import dataset_workload
    from cbrun.bench.workload import random_workload, usable_token_ids, warmup_workload

    text_config = model.config.get_text_config()
    vocab_size = text_config.vocab_size
    context = getattr(text_config, "max_position_embeddings", None) or 1 << 30
    try:
        if opts.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {opts.temperature}")
        token_ids = usable_token_ids(tokenizer, vocab_size)
        skipped: list[str] = []
        if opts.dataset_path is not None:
            workload, skipped = dataset_workload(
                opts.dataset_path,
                tokenizer,
                output_len=opts.output_len,
                max_context=context,
                vocab_size=vocab_size,
                num_prompts=opts.num_prompts,
                n=opts.n,
                ignore_eos=bool(opts.ignore_eos),
                temperature=opts.temperature,
                seed=opts.seed,
            )
        else:
            workload = random_workload(
                token_ids,
                num_prompts=DEFAULT_NUM_PROMPTS if opts.num_prompts is None else opts.num_prompts,
                input_len=opts.input_len,
                output_len=opts.output_len,
                range_ratio=opts.random_range_ratio,
                prefix_len=opts.prefix_len,
                n=opts.n,
                ignore_eos=True if opts.ignore_eos is None else opts.ignore_eos,
                temperature=opts.temperature,
                seed=opts.seed,
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


def _asdict(config: EngineConfig) -> dict:
    from dataclasses import asdict

    return asdict(config)
