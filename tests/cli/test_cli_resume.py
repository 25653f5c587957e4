"""Killed and interrupted runs, then `--resume` (issue 4, "Must show" 3, and Ctrl-C).

A subprocess runs `cbrun generate` with a small window (so rows finish and are
flushed one after another), is killed (SIGKILL) or interrupted (SIGINT) once
some rows are on disk, and the same command with `--resume` finishes the job.
The result must equal an uninterrupted run: one row per (id, sample), same
greedy completions, and rows already written are not generated again.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_helpers import REPO, cli_env, complete_lines, read_jsonl, resume_args as args, write_jsonl

from cbrun.cli.app import main
from cbrun.data.writers import journal_path

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "a",
    "continuous",
    "batching",
    "engine",
    "schedules",
    "prefill",
    "and",
    "decode",
    "tokens",
    "every",
    "step",
    "paged",
    "attention",
    "keeps",
    "keys",
]
# Enough rows that a run at window 2 lasts well past the writer's first 2-second flush (the interrupt tests wait
# for rows on disk, then stop the run: with 24 rows a fast CPU in bf16 had finished them all by then).
NUM_ROWS = 96


def prompts() -> list[dict]:
    return [{"id": f"q{i}", "prompt": " ".join(WORDS[i % 11 : i % 11 + 3 + i % 7])} for i in range(NUM_ROWS)]


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist() if path.suffix == ".parquet" else read_jsonl(path)


def start_and_wait_for_rows(model_dir, source: Path, out: Path, rows_on_disk: Path, at_least: int):
    """Start a slow run (window 2) in a subprocess; return it once `at_least` rows are flushed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cbrun", "generate", str(source), str(out), *args(model_dir, "--window", "2")],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while complete_lines(rows_on_disk) < at_least:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it could be stopped: {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no rows were written in time")
        time.sleep(0.05)
    return proc


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    source = write_jsonl(folder / "in.jsonl", prompts())
    assert main(["generate", str(source), str(folder / "out.jsonl"), *args(tiny_llama_dir, "-q")]) == 0
    rows = read_jsonl(folder / "out.jsonl")
    assert len(rows) == NUM_ROWS
    return {r["id"]: r for r in rows}


def assert_same_as_uninterrupted(rows: list[dict], uninterrupted: dict) -> None:
    keys = [(r["id"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) == NUM_ROWS  # no duplicates, no gaps
    for row in rows:
        expected = uninterrupted[row["id"]]
        assert row["error"] is None and row["finish_reason"] == expected["finish_reason"]
        assert row["completion_token_ids"] == expected["completion_token_ids"], row["id"]
        assert row["completion"] == expected["completion"]


def resume(model_dir, source: Path, out: Path, capsys) -> int:
    """Run --resume in this process; returns how many rows it found already done."""
    capsys.readouterr()
    assert main(["generate", str(source), str(out), *args(model_dir, "--resume")]) == 0
    err = capsys.readouterr().err
    match = re.search(r"already in output \(resume\)\s*│\s*([\d,]+)", err)
    return int(match.group(1).replace(",", "")) if match else 0


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sigkill_then_resume_completes_the_job_exactly(tiny_llama_dir, tmp_path, capsys, uninterrupted, suffix):
    source = write_jsonl(tmp_path / "in.jsonl", prompts())
    out = tmp_path / f"out{suffix}"
    on_disk = journal_path(out) if suffix == ".parquet" else out
    proc = start_and_wait_for_rows(tiny_llama_dir, source, out, on_disk, at_least=3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    written = complete_lines(on_disk)
    assert 3 <= written < NUM_ROWS
    if suffix == ".parquet":
        assert not out.exists()  # only the journal survives a kill
    # without --resume the existing output is refused
    assert main(["generate", str(source), str(out), *args(tiny_llama_dir)]) == 2
    skipped = resume(tiny_llama_dir, source, out, capsys)
    assert skipped >= written - 1  # at most a partial last line is redone
    assert_same_as_uninterrupted(read_rows(out), uninterrupted)
    assert not journal_path(out).exists()


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_ctrl_c_finishes_rows_in_flight_then_resume_completes(tiny_llama_dir, tmp_path, capsys, uninterrupted):
    source = write_jsonl(tmp_path / "in.jsonl", prompts())
    out = tmp_path / "out.jsonl"
    proc = start_and_wait_for_rows(tiny_llama_dir, source, out, out, at_least=2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"--resume" in err
    rows = read_jsonl(out)  # the in-flight rows were finished and written whole
    assert all(r["error"] is None for r in rows) and len(rows) < NUM_ROWS
    assert resume(tiny_llama_dir, source, out, capsys) == len(rows)
    assert_same_as_uninterrupted(read_jsonl(out), uninterrupted)


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_second_ctrl_c_stops_at_once_and_leaves_a_valid_parquet(tiny_llama_dir, tmp_path, capsys, uninterrupted):
    source = write_jsonl(tmp_path / "in.jsonl", prompts())
    out = tmp_path / "out.parquet"
    proc = start_and_wait_for_rows(tiny_llama_dir, source, out, journal_path(out), at_least=2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    rows = read_rows(out)  # finalized: a valid Parquet file, no journal, no "engine stopped" rows
    assert not journal_path(out).exists()
    assert all(r["error"] is None for r in rows) and len(rows) < NUM_ROWS
    assert resume(tiny_llama_dir, source, out, capsys) == len(rows)
    assert_same_as_uninterrupted(read_rows(out), uninterrupted)
