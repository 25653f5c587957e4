"""Peer `transformers`: transformers' own continuous batching.

It runs the machinery `model.generate_batch` is built on
(`model.continuous_batching_context_manager`: init, warm-up, start; then
`add_request` and `get_result`), because `generate_batch` takes one
`max_new_tokens` for all prompts while the workload gives each request its own
length, and because it lets the manager's set-up (sizing and zero-filling its
cache) be left out of the timing, as every other engine's start-up is. The
config is transformers' default `ContinuousBatchingConfig()` unless the user
overrides fields with `--transformers-cb-config`; the result records which.
Ignore-EOS is expressed as `eos_token_id=-1` (transformers' "no EOS").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cbrun.bench.peers import PeerContext
from cbrun.bench.result import PeerResult
from cbrun.bench.workload import Workload

if TYPE_CHECKING:
    from transformers import GenerationConfig

CHILD_MARK = "__child#"


def run(ctx: PeerContext, workload: Workload, warmup: Workload) -> PeerResult:
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cb_config = ContinuousBatchingConfig(**ctx.transformers_cb_config)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(workload.output_lens),
        num_requests=workload.num_prompts * workload.n,
    )
    prompts, output_lens, copies = _expand_greedy_samples(workload)
    ctx.progress.message("[transformers] setting up the continuous batching manager")
    if not ctx.transformers_cb_config and not str(ctx.device).startswith("cuda"):
        ctx.progress.message(
            "[transformers] default ContinuousBatchingConfig on CPU: it sizes its cache from most of "
            "the RAM and zero-fills it (slow, memory-hungry); --transformers-cb-config bounds it"
        )
    setup_start = time.perf_counter()
    with ctx.model.continuous_batching_context_manager(
        generation_config=_generation_config(ctx, workload, copies),
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
        workload_hints=hints,
    ) as manager:
        setup_s = time.perf_counter() - setup_start
        resolved = manager.continuous_batching_config
        _run_pass(manager, warmup.prompts, warmup.output_lens, warmup, ctx, "transformers warm-up")
        result = _run_pass(manager, prompts, output_lens, workload, ctx, "transformers")
    if copies > 1:  # fold the per-sample copies back onto their prompt
        result.output_counts = [
            sum(result.output_counts[i * copies : (i + 1) * copies]) for i in range(workload.num_prompts)
        ]
    result.num_input_tokens = workload.num_input_tokens
    result.details["continuous_batching_config"] = (
        "default ContinuousBatchingConfig()" if not ctx.transformers_cb_config else ctx.transformers_cb_config
    )
    result.details["resolved_cb_config"] = {
        key: getattr(resolved, key, None)
        for key in ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "scheduler_type")
    }
    result.details["setup_s"] = round(setup_s, 3)
    result.notes.append(
        f"manager set-up {setup_s:.1f}s excluded; config: {result.details['continuous_batching_config']}"
    )
    return result


def _expand_greedy_samples(workload: Workload) -> tuple[list[list[int]], list[int], int]:
    """Greedy decoding cannot return several sequences in transformers; submit n copies of each prompt instead."""
    if workload.n == 1 or workload.temperature > 0:
        return workload.prompts, workload.output_lens, 1
    n = workload.n
    prompts = [p for p in workload.prompts for _ in range(n)]
    lens = [o for o in workload.output_lens for _ in range(n)]
    return prompts, lens, n


def _generation_config(ctx: PeerContext, workload: Workload, copies: int) -> GenerationConfig:
    from transformers import GenerationConfig

    sampling = workload.temperature > 0
    eos = -1 if workload.ignore_eos else _eos_token_id(ctx)
    kwargs: dict[str, Any] = dict(max_new_tokens=max(workload.output_lens), do_sample=sampling, eos_token_id=eos)
    if sampling:
        kwargs.update(temperature=workload.temperature, top_k=0, top_p=1.0)
        if copies == 1 and workload.n > 1:
            kwargs["num_return_sequences"] = workload.n
    return GenerationConfig(**kwargs)


def _eos_token_id(ctx: PeerContext) -> int | list[int]:
    eos = getattr(getattr(ctx.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = ctx.tokenizer.eos_token_id
    return -1 if eos is None else eos


def _run_pass(
    manager: Any,
    prompts: list[list[int]],
    output_lens: list[int],
    workload: Workload,
    ctx: PeerContext,
    label: str,
) -> PeerResult:
    """Submit all requests (prefix-sorted), collect every finished one."""
    eos = manager.generation_config.eos_token_id
    num_samples = manager.num_return_sequences
    total = len(prompts) * num_samples
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    counts = [0] * len(prompts)
    ttfts: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    for i in order:
        manager.add_request(
            prompts[i], request_id=f"bench-{i}", max_new_tokens=output_lens[i], record_timestamps=True, eos_token_id=eos
        )
    done = 0
    while done < total:
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers' generation thread stopped with {total - done} requests unfinished")
            continue
        if not out.is_finished():
            continue
        done += 1
        index = int(out.request_id.split(CHILD_MARK)[0].removeprefix("bench-"))
        counts[index] += len(out.generated_tokens)
        if out.timestamps:
            ttfts.append(out.timestamps[0] - out.created_time)
        if out.error is not None:
            errors.append(f"{out.request_id}: {out.error}")
        ctx.progress.update(label, done, total, force=done == total)
    wall = time.perf_counter() - start
    result = PeerResult(
        "transformers",
        wall_s=wall,
        num_requests=workload.num_prompts,
        num_input_tokens=sum(len(p) for p in prompts),
        output_counts=counts,
        ttfts=ttfts,
    )
    if errors:
        result.notes.append(f"{len(errors)} requests failed, first: {errors[0]}")
    return result
