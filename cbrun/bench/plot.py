"""`cbrun bench --plot FILE`: the run's figures side by side, as a PNG or SVG to paste into an issue or a paper.

One model: one bar per engine (output tokens/s, labelled with its dtype and
its ratio to cbrun). Several models (`--model a,b,c`): output tokens/s and
peak RSS against the model's size, one line per engine, with the weights'
own bytes for scale. The machine, the model and the workload in the caption.
Needs matplotlib (`pip install 'cbrun[plot]'`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

FORMATS = (".png", ".svg")


class PlotError(RuntimeError):
    """The plot cannot be drawn (no matplotlib, a format we do not write); the message says why."""


def check_target(path: Path) -> None:
    """Fail before the run, not after it: the suffix and matplotlib."""
    if path.suffix.lower() not in FORMATS:
        raise PlotError(f"--plot writes {' or '.join(FORMATS)} files, not {path.name!r}")
    if not path.parent.is_dir():
        raise PlotError(f"--plot: directory does not exist: {path.parent}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'cbrun[plot]'") from None


def caption(report: dict) -> str:
    """Machine, model and workload in a few lines."""
    machine, config = report.get("machine") or {}, report.get("config") or {}
    flags = [f for f, present in (machine.get("cpu_flags") or {}).items() if present]
    threads = machine.get("torch_threads")
    workload = config.get("workload") or ""
    lines = [
        f"{machine.get('cpu_model', '?')}, {machine.get('cpu_cores', '?')} cores"
        + (f", {threads} threads" if threads else "")
        + (f" ({', '.join(flags)})" if flags else ""),
        f"model {config.get('model')}; {workload}; {config.get('num_prompts')} prompts, "
        f"{config.get('num_input_tokens')} input tokens, up to {config.get('max_output_tokens')} output tokens, "
        f"temperature {config.get('temperature')}",
        f"torch {machine.get('torch')}, transformers {machine.get('transformers')}; "
        "each engine in its dtype, start-up excluded, one warm-up pass",
    ]
    return "\n".join(textwrap.fill(line, 110) for line in lines)


def plot(report: dict, path: Path) -> None:
    """Draw the report's output tokens/s per engine into `path` (.png or .svg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for e in report["results"] if e.get("status") == "ok"]
    if not entries:
        raise PlotError("--plot: no engine finished, nothing to draw")
    labels = [f"{e['engine']}\n{e.get('dtype') or ''}" for e in entries]
    values = [e["output_tokens_per_s"] for e in entries]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.7 * len(entries)))
    bars = ax.barh(labels, values, color=["#3b7dd8" if e["engine"].startswith("cbrun") else "#9a9a9a" for e in entries])
    for bar, entry in zip(bars, entries):
        ratio = entry.get("ratio_to_cbrun")
        text = f" {entry['output_tokens_per_s']:.1f}" + (
            f"  ({ratio:.2f}x cbrun)" if ratio and entry["engine"] != "cbrun" else ""
        )
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s (higher is better)")
    ax.set_xlim(0, max(values) * 1.35)
    ax.set_title("cbrun bench", loc="left", fontsize=11)
    fig.text(0.01, 0.0, caption(report), fontsize=7, va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.12 + 0.02 * len(entries), 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)


def plot_sizes(reports: list[dict], path: Path) -> None:
    """Output tokens/s and peak RSS against parameters, one line per engine, from one report per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(reports, key=lambda r: r["config"].get("parameters") or 0)
    sizes = [r["config"].get("parameters", 0) / 1e9 for r in runs]
    engines = list(dict.fromkeys(e["engine"] for r in runs for e in r["results"]))
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.6))
    for engine in engines:
        style = dict(marker="o", color="#3b7dd8" if engine.startswith("cbrun") else "#9a9a9a", label=engine)
        entries = [_finished(r, engine) for r in runs]
        points = [(size, e) for size, e in zip(sizes, entries) if e is not None]
        speed.plot([s for s, _ in points], [e["output_tokens_per_s"] for _, e in points], **style)
        rss = [(s, e["peak_rss_gb"]) for s, e in points if e.get("peak_rss_gb")]
        memory.plot([s for s, _ in rss], [g for _, g in rss], **style)
    memory.plot(sizes, [r["config"].get("parameter_bytes", 0) / 1e9 for r in runs], "k--", linewidth=1, label="weights")
    for axis, label in ((speed, "output tokens/s"), (memory, "peak RSS, GB")):
        axis.set_xlabel("parameters, billions")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    speed.set_title("throughput against model size", loc="left", fontsize=10)
    memory.set_title("memory against model size", loc="left", fontsize=10)
    names = ", ".join(str(r["config"].get("model_name") or r["config"].get("model")) for r in runs)
    fig.text(0.01, 0.0, caption(runs[-1]).replace(str(runs[-1]["config"].get("model")), names, 1), fontsize=7)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _finished(report: dict, engine: str) -> dict | None:
    return next((e for e in report["results"] if e["engine"] == engine and e.get("status") == "ok"), None)
