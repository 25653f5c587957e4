"""`cbrun generate --ray` on a local Ray cluster (issues 16, 35): storage to storage, nothing lost or doubled.

Ray workers read INPUT and write OUTPUT as part files with manifests; the rows
are bitwise those of one process (the engine is batch-invariant), bad rows are
error rows naming their row as without Ray, and a killed actor, a block that
keeps killing its worker, or a killed driver followed by --resume all end with
every row written once. Skipped when Ray is not installed (`pip install
'cbrun[ray]'`). One local cluster serves the module; each engine actor reserves
half a CPU and runs one thread, as the 2-core CI machine needs.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from cli_helpers import REPO, cli_env, read_jsonl, write_jsonl

from cbrun.cli.app import main

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'cbrun[ray]')")
pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'cbrun[ray]')")

from ray_fakes import DiesOnBigPieces, DiesOnce, ship_by_value  # noqa: E402

from cbrun.data.generate.format import CbrunFormat  # noqa: E402
from cbrun.scale.input_plan import plan_input  # noqa: E402
from cbrun.scale.part_store import PartStore  # noqa: E402
from cbrun.scale.ray_job import RayJob, RayProgress, run_to_output, start_ray  # noqa: E402

NUM_ROWS = 300
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
    "while",
    "paged",
    "attention",
    "keeps",
    "keys",
]
pytestmark = pytest.mark.slow  # a Ray cluster: the full suite only


def prompts(count: int = NUM_ROWS) -> list:
    rows: list = [{"id": f"r{i}", "prompt": " ".join(WORDS[i % 7 : i % 7 + 2 + i % 6])} for i in range(count)]
    rows[7] = {"id": "empty", "prompt": ""}  # an error row, not a failed task
    rows[20] = "{not json"  # an unparseable line: its row number is its id
    rows[31] = ""  # a blank line: not a row, but the line numbers after it move on
    return rows


def engine_args(model_dir) -> list[str]:
    return ["-m", str(model_dir), "--max-tokens", "8", "--temperature", "0", "--num-blocks", "256"]


@pytest.fixture(scope="module")
def local_cluster():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    start_ray(None, threads=1, quiet=True)
    ship_by_value()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def single_process(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    source = write_jsonl(folder / "in.jsonl", prompts())
    out = folder / "out.parquet"
    assert main(["generate", str(source), str(out), *engine_args(tiny_llama_dir), "--logprobs", "-q"]) == 1
    return source, {r["id"]: r for r in pq.read_table(out).to_pylist()}


def assert_same_rows(rows: list[dict], expected: dict, logprobs: bool = True) -> None:
    """Every id once, with bitwise the same tokens and logprobs (the engine is batch-invariant, so which
    replica and which block a row ran in does not matter) and the same error messages."""
    assert sorted(r["id"] for r in rows) == sorted(expected)
    for row in rows:
        want = expected[row["id"]]
        assert row["completion_token_ids"] == want["completion_token_ids"], row["id"]
        assert (row["finish_reason"], row["error"]) == (want["finish_reason"], want["error"])
        if logprobs:
            assert row["logprobs"] == want["logprobs"], row["id"]


def test_two_replicas_write_parts_with_the_rows_of_one_process(local_cluster, tiny_llama_dir, single_process, tmp_path):
    source, expected = single_process
    out = tmp_path / "ray.parquet"
    args = ["generate", str(source), str(out), *engine_args(tiny_llama_dir), "--logprobs", "-q"]
    assert main([*args, "--ray", "--replicas", "2", "--window", "64"]) == 1  # the error rows, as in one process
    parts = sorted(out.glob("part-*.parquet"))
    manifests = sorted((out / ".cbrun" / "manifests").iterdir())
    assert len(parts) >= 5 and [m.stem for m in manifests] == [p.stem for p in parts]
    assert_same_rows(pads.dataset(out, format="parquet").to_table().to_pylist(), expected)
    assert expected["20"]["error"].startswith("row 20: not valid JSON")
    assert expected["r40"]["error"] is None

    # one dataset for every reader: Ray Data, pyarrow, Hugging Face datasets, DuckDB
    assert ray.data.read_parquet(str(out)).count() == len(expected) == NUM_ROWS - 1  # a blank line is no row
    assert pq.read_table(out).num_rows == len(expected)
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert sorted(loaded["id"]) == sorted(expected)
    duckdb = pytest.importorskip("duckdb")
    ((count,),) = duckdb.sql(f"select count(distinct id) from read_parquet('{out}/*.parquet')").fetchall()
    assert count == len(expected)


def test_parquet_input_to_json_lines_parts_keeps_row_numbers_and_columns(local_cluster, tiny_llama_dir, tmp_path):
    records = [{"id": f"p{i}", "prompt": " ".join(WORDS[i % 5 : i % 5 + 3]), "topic": i % 3} for i in range(120)]
    records[9]["prompt"] = ""
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(records), source, row_group_size=50)
    args = ["generate", str(source), "", *engine_args(tiny_llama_dir), "--keep-columns", "topic", "-q"]
    args[2] = str(tmp_path / "one.jsonl")
    assert main(args) == 1
    args[2] = str(tmp_path / "ray.jsonl")
    assert main([*args, "--ray", "--replicas", "2", "--window", "32"]) == 1
    parts = sorted((tmp_path / "ray.jsonl").glob("part-*.jsonl"))
    rows = [r for p in parts for r in read_jsonl(p)]
    expected = {r["id"]: r for r in read_jsonl(tmp_path / "one.jsonl")}
    assert_same_rows(rows, expected, logprobs=False)
    assert {r["id"]: r["topic"] for r in rows} == {r["id"]: r["topic"] for r in records}
    assert expected["p9"]["error"] == "row 9: prompt: empty prompt"


def _job(source: Path, out: Path, model: str, replicas: int, window: int, **generator) -> RayJob:
    plan = plan_input(str(source), parallelism=replicas * 8)
    store = PartStore(out, "parquet", run=f"test-{time.monotonic_ns()}")
    return RayJob(
        plan=plan,
        store=store,
        fmt=CbrunFormat(logprobs=True),
        generator=dict(model=model, **generator),
        replicas=replicas,
        threads=1,
        cpus_per_replica=0.5,
        window=window,
    )


def test_an_actor_killed_mid_block_is_restarted_and_every_row_is_written_once(
    local_cluster, tiny_llama_dir, single_process, tmp_path
):
    source, expected = single_process
    marker = tmp_path / "crashed"
    job = _job(
        source,
        tmp_path / "out.parquet",
        str(tiny_llama_dir),
        replicas=2,
        window=64,
        sampling=dict(max_tokens=8, temperature=0.0),
        engine=dict(num_blocks=256),
        logprobs=True,
        crash_marker=str(marker),
    )
    progress = RayProgress()
    run_to_output(job, progress, resume=False, overwrite=False, view=False, udf=DiesOnce)
    assert marker.exists()  # one actor did die, in the middle of a block
    assert progress.retried_blocks >= 1 and (progress.missing_rows, progress.doubled_rows) == (0, 0)
    assert_same_rows(pads.dataset(job.store.root, format="parquet").to_table().to_pylist(), expected)


def test_blocks_that_keep_killing_their_worker_are_split_and_a_fatal_row_becomes_an_error_row(local_cluster, tmp_path):
    """Row 37 kills any worker generating it (as an out-of-memory kill would): its block is cut into pieces
    (the other rows written), then the row alone is tried three times and written as an error row."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"row {i}"} for i in range(96)])
    job = _job(source, tmp_path / "out.parquet", "fake", replicas=2, window=24, max_rows=1000, poison=37)
    job.generator["sampling"] = dict(max_tokens=4, seed=0)
    progress = RayProgress()
    run_to_output(job, progress, resume=False, overwrite=False, view=False, udf=DiesOnBigPieces)
    rows = pads.dataset(job.store.root, format="parquet").to_table().to_pylist()
    assert collections.Counter(r["id"] for r in rows) == {f"q{i}": 1 for i in range(96)}
    (fatal,) = [r for r in rows if r["error"]]
    assert fatal["id"] == "q37" and "died 3 times while it ran alone" in fatal["error"]
    assert progress.given_up == 1 and progress.retried_blocks == 1 and progress.rows_done == 96
    assert len(list(job.store.root.glob("part-*"))) > 96 // 12  # the poisoned block was written in pieces


def test_a_killed_driver_is_finished_by_resume_with_every_row_once(local_cluster, tiny_llama_dir, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", prompts(1200))
    single = tmp_path / "single.parquet"
    assert main(["generate", str(source), str(single), *engine_args(tiny_llama_dir), "-q"]) == 1
    expected = {r["id"]: r for r in pq.read_table(single).to_pylist()}
    out = tmp_path / "out.parquet"
    command = [sys.executable, "-m", "cbrun", "generate", str(source), str(out), *engine_args(tiny_llama_dir)]
    command += ["--ray", "--replicas", "2", "--window", "50", "-q"]
    driver = subprocess.Popen(command, cwd=REPO, env=cli_env(), start_new_session=True, stderr=subprocess.PIPE)
    manifests = out / ".cbrun" / "manifests"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(manifests.glob("*.manifest"))) < 3:
        assert driver.poll() is None, driver.stderr.read().decode()[-2000:] if driver.stderr else ""
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and the local cluster it started, as a lost head node
    driver.wait()
    before = {
        p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet") if (manifests / f"{p.stem}.manifest").exists()
    }
    assert len(before) > 0 and sum(1 for _ in out.glob("part-*")) < 1200 / 50

    resume = ["generate", str(source), str(out), *engine_args(tiny_llama_dir), "--ray", "--replicas", "2"]
    assert main([*resume, "--window", "50", "--resume", "-q"]) == 1
    rows = pads.dataset(out, format="parquet").to_table().to_pylist()
    assert_same_rows(rows, expected, logprobs=False)
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    assert all(after[name] == mtime for name, mtime in before.items())  # written parts were not run again
    assert not list((out / ".cbrun" / "attempts").glob("*/*"))
    assert json.loads((out / ".cbrun" / "job.json").read_text())["format"] == "parquet"
