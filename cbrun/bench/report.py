"""The benchmark report: one JSON-ready dict, printed as a rich table and vLLM-style lines.

The dict is the single source: the table, the `Throughput:` lines and
`--output-json` are all rendered from it with the same rounding (`fmt`), so
what is printed and what is saved always agree.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any, TextIO

from cbrun.bench.ceiling import ceiling_fraction
from cbrun.bench.result import PeerResult

CBRUN_STATS_LABELS = {
    "steps": "steps",
    "mean_decode_batch": "mean decode batch",
    "peak_kv_occupancy": "peak KV occupancy",
    "prefix_hit_rate": "prefix hit rate",
    "offloads": "offloads",
    "soft_resets": "soft resets",
}


def fmt(value: float | None, digits: int = 2) -> str:
    """How every figure is shown: fixed decimals, '-' when not measured."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def machine_info(device: str) -> dict:
    """CPU model, cores, library versions and device, so figures can be compared across machines."""
    import torch
    import transformers

    from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags, cpu_model

    flags = set(cpu_flags().split())
    return {
        "cpu_model": cpu_model() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def build_report(
    config: dict,
    machine: dict,
    results: list[PeerResult],
    ceiling: dict | None,
    checks: dict[str, str | None],
    run_dtype: str,
    computed_input_tokens: int | None = None,
) -> dict:
    """The JSON document: config, machine, compute ceiling, one entry per engine, cbrun's engine statistics.

    The compute-ceiling fractions count `computed_input_tokens` (the prompt tokens left once shared
    prefixes are computed once: Workload.num_distinct_prompt_tokens) plus the output tokens, so a
    workload whose prompts share a prefix is not credited with work no engine does; without it,
    every input token counts."""
    cbrun = next((r for r in results if r.engine == "cbrun" and r.ok), None)
    entries = [_entry(r, cbrun, ceiling, checks.get(r.engine), run_dtype, computed_input_tokens) for r in results]
    return {
        "config": config,
        "machine": machine,
        "compute_ceiling": ceiling,
        "results": entries,
        "cbrun_stats": cbrun.details.get("stats") if cbrun else None,
    }


def _entry(
    r: PeerResult,
    cbrun: PeerResult | None,
    ceiling: dict | None,
    check: str | None,
    run_dtype: str,
    computed_input_tokens: int | None,
) -> dict:
    entry: dict[str, Any] = {
        "engine": r.engine,
        "status": r.status,
        "reason": r.reason,
        "dtype": r.dtype or run_dtype,
        "peak_rss_gb": r.peak_rss_bytes / 1e9 if r.peak_rss_bytes else None,
    }
    if not r.ok:
        return entry
    ratio = r.output_tokens_per_s / cbrun.output_tokens_per_s if cbrun and cbrun.output_tokens_per_s else None
    computed = r.num_input_tokens if computed_input_tokens is None else computed_input_tokens
    computed_per_s = (computed + r.num_output_tokens) / r.wall_s if r.wall_s > 0 else 0.0
    entry.update(
        wall_s=r.wall_s,
        num_requests=r.num_requests,
        num_input_tokens=r.num_input_tokens,
        num_output_tokens=r.num_output_tokens,
        requests_per_s=r.requests_per_s,
        input_tokens_per_s=r.input_tokens_per_s,
        output_tokens_per_s=r.output_tokens_per_s,
        total_tokens_per_s=r.total_tokens_per_s,
        ttft_p50_s=r.ttft_percentile(50),
        ttft_p99_s=r.ttft_percentile(99),
        ratio_to_cbrun=ratio,
        computed_tokens_per_s=computed_per_s,
        compute_ceiling_fraction=ceiling_fraction(computed_per_s, ceiling) if ceiling else None,
        compute_ceiling_fraction_run_dtype=ceiling_fraction(computed_per_s, ceiling, run_dtype) if ceiling else None,
        compute_ceiling_fraction_int8=ceiling_fraction(computed_per_s, ceiling, "int8") if ceiling else None,
        output_count_check=check or "ok",
        notes=r.notes,
        details=r.details,
    )
    return entry


TABLE_COLUMNS = [  # (header, key, digits)
    ("wall s", "wall_s", 2),
    ("req/s", "requests_per_s", 2),
    ("in tok/s", "input_tokens_per_s", 1),
    ("out tok/s", "output_tokens_per_s", 1),
    ("total tok/s", "total_tokens_per_s", 1),
    ("TTFT p50 s", "ttft_p50_s", 3),
    ("TTFT p99 s", "ttft_p99_s", 3),
    ("out vs cbrun", "ratio_to_cbrun", 2),
    ("ceiling {dtype}", "compute_ceiling_fraction_run_dtype", 3),  # of the GEMM rate in the dtype the engines ran
    ("out tokens", "num_output_tokens", 0),
    ("peak RSS GB", "peak_rss_gb", 2),
]


def print_report(report: dict, file: TextIO | None = None) -> None:
    """The table, cbrun's engine statistics, notes, mismatches and the `Throughput:` lines."""
    from rich.console import Console
    from rich.table import Table

    file = file or sys.stdout
    console = Console(file=file, width=None if file.isatty() else 200, highlight=False, soft_wrap=True)
    table = Table(title="cbrun bench")
    table.add_column("engine")
    table.add_column("dtype")
    run_dtype = report["config"].get("dtype_resolved", "")
    for header, _, _ in TABLE_COLUMNS:
        table.add_column(header.format(dtype=run_dtype).strip(), justify="right")
    for e in report["results"]:
        if e["status"] != "ok":
            table.add_row(e["engine"], "", e["status"], *[""] * (len(TABLE_COLUMNS) - 1))
            continue
        cells = [fmt(e[key], digits) for _, key, digits in TABLE_COLUMNS]
        if e["output_count_check"] != "ok":
            cells[-1] += " MISMATCH" if report["config"].get("ignore_eos") else " (differs)"
        table.add_row(e["engine"], e.get("dtype") or "", *cells)
    console.print(table)
    for line in report_lines(report):
        console.print(line, markup=False)


def report_lines(report: dict) -> list[str]:
    """Plain lines under the table (also what tests read)."""
    lines = []
    stats = report.get("cbrun_stats")
    if stats:
        parts = [f"{label} {_stat(stats.get(key), key)}" for key, label in CBRUN_STATS_LABELS.items()]
        lines.append("cbrun engine: " + ", ".join(parts))
    machine = report.get("machine") or {}
    if (
        machine.get("load_average_1m")
        and machine.get("cpu_cores")
        and machine["load_average_1m"] > machine["cpu_cores"]
    ):
        lines.append(
            f"Warning: load average {machine['load_average_1m']} on {machine['cpu_cores']} cores at the end "
            "of the run: other processes shared the CPU, figures are low and noisy"
        )
    ceiling = report.get("compute_ceiling")
    if ceiling:
        rates = ", ".join(f"{dtype} {fmt(r['best'], 1)}" for dtype, r in ceiling["gemm_gflops"].items())
        lines.append(
            f"Compute: {fmt(ceiling['gflop_per_token'], 4)} GFLOP/token; GEMM GFLOP/s at "
            f"{ceiling['gemm_rows']} rows: {rates}"
        )
    for e in report["results"]:
        if e["status"] != "ok":
            lines.append(f"{e['engine']}: {e['status']}: {e['reason']}")
            continue
        for note in e["notes"]:
            lines.append(f"{e['engine']}: {note}")
        if e["output_count_check"] != "ok":
            what = "OUTPUT TOKEN COUNT MISMATCH" if report["config"].get("ignore_eos") else "Output token counts differ"
            lines.append(f"{what}: {e['output_count_check']}")
    for e in report["results"]:
        if e["status"] == "ok" and e["compute_ceiling_fraction"] is not None:
            run_dtype = report["config"].get("dtype_resolved", "")
            lines.append(
                f"Compute ceiling fraction: {fmt(e['compute_ceiling_fraction'], 3)} of bf16 GEMM, "
                f"{fmt(e['compute_ceiling_fraction_run_dtype'], 3)} of {run_dtype} GEMM"
                + (
                    f", {fmt(e['compute_ceiling_fraction_int8'], 3)} of int8 GEMM"
                    if e.get("compute_ceiling_fraction_int8") is not None
                    else ""
                )
                + f" ({e['engine']})"
            )
    for e in report["results"]:
        if e["status"] == "ok":
            lines.append(
                f"Throughput: {fmt(e['requests_per_s'])} requests/s, {fmt(e['total_tokens_per_s'])} total "
                f"tokens/s, {fmt(e['output_tokens_per_s'])} output tokens/s ({e['engine']})"
            )
    return lines


def _stat(value: float | None, key: str) -> str:
    if key in ("peak_kv_occupancy", "prefix_hit_rate") and value is not None:
        return f"{100 * value:.1f}%"
    return fmt(value, 1)
