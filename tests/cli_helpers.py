"""Helpers of the command-line tests, shared by tests/cli, tests/scale and others: JSON Lines in and out, the
engine options of a quick tiny-model run, and a subprocess environment that imports this checkout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]


def engine_args(model_dir, max_tokens=8) -> list[str]:
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


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def by_key(rows) -> dict:
    return {(r["id"], r["sample"]): r for r in rows}


def cli_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def resume_args(model_dir, *extra) -> list[str]:
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


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist() if path.suffix == ".parquet" else read_jsonl(path)


def complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0
