"""What the command-line tests of every subsystem share: the repository, a subprocess environment,
JSON Lines in and out, and the engine flags that keep a tiny model's run small and greedy.

At tests/ (not in tests/cli/), like helpers.py, so that tests in any directory import it the same way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def engine_args(model_dir, max_tokens=8) -> list[str]:
    """`cbrun generate` flags for a small greedy run of `model_dir`, quiet."""
    return [
        "-m",
        str(model_dir),
        "--max-tokens",
        str(max_tokens),
        "--temperature",
        "0",
        "--num-blocks",
        "128",
        "--page-size",
        "16",
        "-q",
    ]


def resume_args(model_dir, *extra) -> list[str]:
    """`cbrun generate` flags of the resume tests: 16 greedy tokens, a larger cache, then `extra`."""
    return [
        "-m",
        str(model_dir),
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--num-blocks",
        "256",
        "--page-size",
        "16",
        *extra,
    ]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def complete_lines(path: Path) -> int:
    """Whole lines in `path` so far (0 before it exists)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def cli_env() -> dict:
    """The environment of a `python -m cbrun` subprocess: this checkout first on the path."""
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
