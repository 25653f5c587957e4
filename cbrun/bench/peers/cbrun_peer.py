"""Peer `cbrun`: our Engine, through its public API only.

Engine start-up (cache allocation, and touching the cache blocks the
workload can use, as vLLM does for its whole cache) is excluded from timing. The warm-up and
the timed pass share one engine; the engine's counters are cumulative, so its
statistics for the timed pass are the difference of two snapshots.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from cbrun.bench.peers import PeerContext
from cbrun.bench.result import PeerResult, PeerUnavailable
from cbrun.bench.structured import Validity
from cbrun.bench.workload import Workload

if TYPE_CHECKING:
    from cbrun.engine import Engine, EngineConfig
    from cbrun.engine.stats import StatsSnapshot


def run_free(ctx: PeerContext, workload: Workload, warmup: Workload) -> PeerResult:
    """Peer `cbrun-free`: the same prompts with their structured-output constraints dropped."""
    from dataclasses import replace

    result = run(ctx, replace(workload, structured=None), replace(warmup, structured=None))
    result.engine = "cbrun-free"
    return result


def run(ctx: PeerContext, workload: Workload, warmup: Workload) -> PeerResult:
    try:
        from cbrun.engine import Engine
    except ImportError as e:
        raise PeerUnavailable(f"cbrun.engine.Engine is not importable: {e}") from e

    ctx.progress.message("[cbrun] starting engine")
    engine = Engine(ctx.model, ctx.tokenizer, _with_prefault(ctx.engine_config, workload))
    try:
        _run_pass(engine, warmup, ctx, "cbrun warm-up")
        before = engine.stats()
        if ctx.dashboard is not None:  # the dashboard shows progress; no plain lines beside it
            with ctx.dashboard(engine, title="cbrun bench"):
                result = _run_pass(engine, workload, ctx, None)
        else:
            result = _run_pass(engine, workload, ctx, "cbrun")
        after = engine.stats()
    finally:
        engine.stop(hard=True)
        engine.destroy(give_back_weights=ctx.model_needed_later)
    result.details["stats"] = stats_delta(before, after)
    result.details["engine_config"] = _config_dict(ctx.engine_config)
    if getattr(ctx.engine_config, "quantization", None) == "int8":  # the table's dtype column: what the linears ran in
        result.dtype = "int8 W8A8"
    return result


def _run_pass(engine: Engine, workload: Workload, ctx: PeerContext, label: str | None) -> PeerResult:
    """Submit every request up front and wait for all results (progress lines under `label`, if any)."""
    total = workload.num_prompts * workload.n
    counts = [0] * workload.num_prompts
    ttfts: list[float] = []
    errors: list[str] = []
    validity = Validity() if workload.is_structured else None
    start = time.perf_counter()
    index_of, calls = _submit(engine, workload)
    for done, out in enumerate(engine, start=1):
        counts[index_of[out.request_id]] += len(out.token_ids)
        spec = workload.constraint(index_of[out.request_id])
        if validity is not None and spec is not None and out.ok:
            validity.add(spec, out.text, out.finish_reason)
        if out.ttft_s is not None:
            ttfts.append(out.ttft_s)
        if not out.ok:
            errors.append(f"{out.request_id}: {out.finish_reason} {out.error or ''}".strip())
        if label:
            ctx.progress.update(label, done, total, force=done == total)
    wall = time.perf_counter() - start
    result = PeerResult(
        "cbrun",
        wall_s=wall,
        num_requests=workload.num_prompts,
        num_input_tokens=workload.num_input_tokens,
        output_counts=counts,
        ttfts=ttfts,
    )
    if hasattr(engine, "linear_kernels"):
        result.details["linear_kernels"] = engine.linear_kernels()
        result.notes.append(f"linear kernels: {engine.linear_kernels()}")
    if calls > 1:
        result.notes.append(f"submitted in {calls} add_requests calls (one per distinct output length)")
    if errors:
        result.notes.append(f"{len(errors)} requests failed, first: {errors[0]}")
    if validity is not None:
        result.notes.append(validity.note())
        result.details["structured"] = validity.as_dict()
    return result


def _submit(engine: Engine, workload: Workload) -> tuple[dict[str, int], int]:
    """Queue the whole workload in one prefix-sorted `add_requests` call.

    Each request gets its own output length and its own seed (`Workload.request_seed`).
    Returns request id -> prompt index, and the number of calls (1).
    """
    from cbrun.engine import SamplingParams

    params = [
        SamplingParams(
            max_tokens=length,
            temperature=workload.temperature,
            ignore_eos=workload.ignore_eos,
            n=workload.n,
            seed=workload.request_seed(i),
            structured=workload.constraint(i),
        )
        for i, length in enumerate(workload.output_lens)
    ]
    ids = [f"bench-{i}" for i in range(workload.num_prompts)]
    engine.add_requests(workload.prompts, params, request_ids=ids)
    return {rid: i for i, rid in enumerate(ids)}, 1


def _with_prefault(config: EngineConfig | None, workload: Workload) -> EngineConfig:
    """The engine config with the workload's worst-case cache blocks touched at start-up.

    vLLM allocates and zero-fills its whole cache at start-up, which bench
    excludes; cbrun's cache is lazy, so without this the timed pass would pay
    the page faults of every first-used block (on a VM, ~5 ms per MiB: about
    5 s of a 2-minute run). Start-up is excluded for both, so both pay it there.
    """
    from dataclasses import replace

    from cbrun.engine import EngineConfig

    config = config or EngineConfig()
    if config.prefault_blocks:
        return config
    page = config.page_size
    need = sum(-(-(len(prompt) + out) // page) for prompt, out in zip(workload.prompts, workload.output_lens))
    return replace(config, prefault_blocks=need * workload.n)


def stats_delta(before: StatsSnapshot, after: StatsSnapshot) -> dict:
    """The timed pass's engine figures from two cumulative StatsSnapshots."""
    prompt = after.prompt_tokens - before.prompt_tokens
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    decode_steps = after.decode_steps - before.decode_steps
    decode_tokens = after.decode_batch_tokens - before.decode_batch_tokens
    return {
        "steps": after.steps - before.steps,
        "mean_decode_batch": decode_tokens / decode_steps if decode_steps else 0.0,
        "peak_kv_occupancy": after.peak_blocks_used / after.blocks_total if after.blocks_total else 0.0,
        "kv_blocks_total": after.blocks_total,
        "prefix_hit_tokens": hits,
        "prefix_hit_rate": hits / prompt if prompt else 0.0,
        "offloads": after.offloads - before.offloads,
        "soft_resets": after.soft_resets - before.soft_resets,
    }


def _config_dict(config: object) -> dict | None:
    if config is None:
        return None
    from dataclasses import asdict, is_dataclass

    return asdict(config) if is_dataclass(config) and not isinstance(config, type) else dict(vars(config))
