"""Runs the requested engines one after another on the same workload and builds the report."""

from __future__ import annotations

import gc
import traceback

from cbrun.bench.ceiling import measure_ceiling
from cbrun.bench.memory import PeakRss
from cbrun.bench.peers import PeerContext
from cbrun.bench.peers.registry import peer_runner
from cbrun.bench.report import build_report, machine_info
from cbrun.bench.result import PeerResult, PeerUnavailable, count_check
from cbrun.bench.workload import Workload


def run_bench(
    engines: list[str], ctx: PeerContext, workload: Workload, warmup: Workload, config: dict, with_ceiling: bool = True
) -> dict:
    """Warm-up and timed pass per engine, output-count checks, compute ceiling; returns the report dict.

    An engine that cannot run here is reported "unavailable"; one that raises
    is reported "failed" with its error; neither stops the others.
    """
    results = []
    for position, name in enumerate(engines):
        ctx.model_needed_later = model_needed_after(engines[position + 1 :], ctx.model_spec)
        results.append(_run_one(name, ctx, workload, warmup))
    checks = output_checks(results, workload)
    ceiling = None
    if with_ceiling:
        ctx.progress.message("[bench] measuring the GEMM rate")
        quantization = getattr(ctx.engine_config, "quantization", None)
        ceiling = measure_ceiling(ctx.model, ctx.dtype, ctx.device, quantization)
    run_dtype = str(ctx.dtype).removeprefix("torch.")
    return build_report(
        config, machine_info(ctx.device), results, ceiling, checks, run_dtype, workload.num_distinct_prompt_tokens
    )


def _run_one(name: str, ctx: PeerContext, workload: Workload, warmup: Workload) -> PeerResult:
    ctx.progress.message(
        f"[bench] {name}: {workload.num_prompts} prompts x {workload.n}, "
        f"{workload.num_input_tokens} input tokens, up to {workload.max_output_tokens} output tokens"
    )
    attention = getattr(ctx.model.config, "_attn_implementation", None)
    memory = PeakRss(children=name == "vllm")  # vLLM's processes; the others run in this one
    try:
        with memory:
            result = peer_runner(name)(ctx, workload, warmup)
    except PeerUnavailable as e:
        result = PeerResult(name, status="unavailable", reason=str(e))
    except Exception as e:  # a broken peer must not hide the others' figures
        ctx.progress.message(traceback.format_exc())
        result = PeerResult(name, status="failed", reason=f"{type(e).__name__}: {e}")
    finally:  # engines switch the model's attention to their own; give the next peer the model as loaded
        if attention and getattr(ctx.model.config, "_attn_implementation", None) != attention:
            ctx.model.set_attn_implementation(attention)
    gc.collect()
    in_children = name == "vllm" and memory.children > 0  # vLLM's own processes (unless it ran in this one)
    result.peak_rss_bytes = memory.children if in_children else memory.own
    if result.ok:
        ctx.progress.message(f"[bench] {name}: {result.wall_s:.2f}s, {result.output_tokens_per_s:.1f} output tokens/s")
    else:
        ctx.progress.message(f"[bench] {name}: {result.status}: {result.reason}")
    return result


def model_needed_after(later: list[str], model_spec: str) -> bool:
    """Whether an engine still to run reads the loaded model's weights: every in-process peer does, and vLLM
    does when it has no checkpoint directory to load (it is given an export of the loaded model). Otherwise
    cbrun frees its packed weights at the end instead of giving the model a dense copy back (an 8B model
    and vLLM's own copy of it would not fit one machine)."""
    from pathlib import Path

    spec = Path(model_spec).expanduser()
    has_checkpoint = spec.is_dir() and (spec / "config.json").is_file() and any(spec.glob("*.safetensors"))
    return any(name != "vllm" or not has_checkpoint for name in later)


def output_checks(results: list[PeerResult], workload: Workload) -> dict[str, str | None]:
    """Per engine, None when its output token counts are as required, else what differs."""
    expected = [workload.n * o for o in workload.output_lens] if workload.ignore_eos else None
    reference = next((r for r in results if r.ok and r.engine == "cbrun"), None)
    reference = reference or next((r for r in results if r.ok), None)
    return {r.engine: count_check(r, expected, reference) for r in results}
