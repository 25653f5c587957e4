"""Deterministic shards (issue 16): `--num-shards N --shard-index I` and the schedulers' environment.

N processes that each keep the rows whose id hashes to their shard must
partition the input exactly: every id once, bad rows included, nothing counted
as an error that belongs to another shard. A killed shard resumes on its own.
"""

from __future__ import annotations

import json
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
from cbrun.data.reader import RawRow
from cbrun.scale.shards import Shard, ShardError, resolve_shard, select_rows, shard_of, shard_output

NUM_ROWS = 1000
NO_ENV: dict = {}


def thousand_rows_file(path: Path) -> Path:
    """1,000 rows: ids, a row without id, a duplicate id, an empty prompt and an unparseable line."""
    lines = [json.dumps({"id": f"q{i}", "input_ids": [1, 40 + i % 50, 41 + i % 7]}) for i in range(NUM_ROWS)]
    lines[10] = json.dumps({"input_ids": [1, 44, 45]})  # no id: its id is the row number, "10"
    lines[11] = json.dumps({"id": "q0", "input_ids": [1, 46]})  # duplicate of row 0: same shard as q0
    lines[12] = json.dumps({"id": "q12", "prompt": ""})  # empty prompt
    lines[13] = "{not json"  # unparseable: id is the row number, "13"
    path.write_text("\n".join(lines) + "\n")
    return path


def expected_ids() -> list[str]:
    ids = [f"q{i}" for i in range(NUM_ROWS)]
    ids[10], ids[11], ids[13] = "10", "q0", "13"
    return ids


# --- the hash and the environment ------------------------------------------------------


def test_shard_of_is_a_stable_hash_not_pythons_salted_one():
    assert [shard_of(f"row-{i}", 7) for i in range(8)] == [shard_of(f"row-{i}", 7) for i in range(8)]
    assert shard_of("q1", 1) == 0
    assert shard_of("hello", 1000) == 741  # blake2b-8 of the UTF-8 id, big-endian, mod N: fixed forever


@pytest.mark.parametrize("count", [1, 3, 7])
def test_select_rows_partitions_rows_and_keeps_global_row_numbers(count):
    rows = [RawRow(i, {"id": f"q{i}"} if i % 5 else {"prompt": "no id"}) for i in range(NUM_ROWS)]
    rows.append(RawRow(NUM_ROWS, None, "not valid JSON"))
    seen = []
    for index in range(count):
        kept = list(select_rows(rows, Shard(index, count, "test")))
        seen += [r.index for r in kept]
        assert all(
            shard_of(str(r.record["id"]) if r.record and "id" in r.record else str(r.index), count) == index
            for r in kept
        )
    assert sorted(seen) == list(range(NUM_ROWS + 1))


@pytest.mark.parametrize(
    ("env", "index", "count", "source"),
    [
        (
            {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"},
            3,
            8,
            "SLURM_ARRAY_TASK_ID=3; SLURM_ARRAY_TASK_COUNT=8",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "8"},
            4,
            8,
            "SLURM_ARRAY_TASK_ID=5 - SLURM_ARRAY_TASK_MIN=1",
        ),
        (
            {
                "SLURM_ARRAY_TASK_ID": "14",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_STEP": "2",
                "SLURM_ARRAY_TASK_COUNT": "8",
            },
            7,
            8,
            "SLURM_ARRAY_TASK_STEP=2",
        ),
        ({"JOB_COMPLETION_INDEX": "2", "CBRUN_NUM_SHARDS": "4"}, 2, 4, "JOB_COMPLETION_INDEX=2; CBRUN_NUM_SHARDS=4"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, 1, 2, "RANK=1; WORLD_SIZE=2"),
        (
            {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2", "RANK": "5", "WORLD_SIZE": "9"},
            0,
            2,
            "SLURM_ARRAY_TASK_ID=0",
        ),  # Slurm wins over RANK/WORLD_SIZE
    ],
)
def test_shard_numbers_come_from_the_schedulers_environment(env, index, count, source):
    shard = resolve_shard(None, None, env)
    assert (shard.index, shard.count) == (index, count)
    assert source in shard.source


def test_flags_override_the_environment_and_one_shard_is_no_sharding():
    env = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"}
    assert resolve_shard(4, 1, env) == Shard(1, 4, "--shard-index/--num-shards")
    shard = resolve_shard(16, None, env)  # index from Slurm, count from the flag
    assert (shard.index, shard.count, shard.source) == (3, 16, "SLURM_ARRAY_TASK_ID=3; --num-shards")
    assert resolve_shard(None, None, NO_ENV) is None
    assert resolve_shard(1, 0, NO_ENV) is None
    assert resolve_shard(None, None, {"RANK": "0", "WORLD_SIZE": "1"}) is None


@pytest.mark.parametrize(
    ("num", "index", "env", "message"),
    [
        (None, 2, NO_ENV, "--shard-index needs --num-shards"),
        (4, None, NO_ENV, "--num-shards needs --shard-index"),
        (4, 4, NO_ENV, "shard index 4 (--shard-index) is outside 0..3"),
        (0, 0, NO_ENV, "at least 1"),
        (None, None, {"JOB_COMPLETION_INDEX": "1"}, "set CBRUN_NUM_SHARDS or pass --num-shards"),
        (None, None, {"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'x'"),
        (None, None, {"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "4"}, "outside 0..3"),
        (
            None,
            None,
            {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_STEP": "2", "SLURM_ARRAY_TASK_COUNT": "4"},
            "not on the array's step",
        ),
    ],
)
def test_bad_shard_numbers_are_one_line_errors(num, index, env, message):
    with pytest.raises(ShardError, match=re.escape(message)):
        resolve_shard(num, index, env)


def test_each_shard_gets_its_own_output(tmp_path):
    shard = Shard(3, 8, "test")
    assert shard_output(str(tmp_path / "out.parquet"), shard) == (
        str(tmp_path / "out.parquet" / "part-00003-of-00008.parquet"),
        True,
    )
    assert shard_output(str(tmp_path / "out-{shard:03d}-of-{num_shards}.jsonl"), shard) == (
        str(tmp_path / "out-003-of-8.jsonl"),
        False,
    )
    assert shard_output("-", shard) == ("-", False)
    (tmp_path / "file.jsonl").write_text("")
    with pytest.raises(ShardError, match="is a file"):
        shard_output(str(tmp_path / "file.jsonl"), shard)
    with pytest.raises(ShardError, match=r"only \{shard\} and \{num_shards\}"):
        shard_output(str(tmp_path / "out-{rank}.jsonl"), shard)


# --- the command line ----------------------------------------------------------------------


def shard_args(model_dir) -> list[str]:
    return [
        "-m",
        str(model_dir),
        "--max-tokens",
        "1",
        "--temperature",
        "0",
        "--num-blocks",
        "512",
        "--page-size",
        "16",
        "-q",
    ]


@pytest.mark.parametrize("count", [1, 3, 7])
def test_shards_of_a_thousand_row_file_partition_it_exactly(tiny_llama_dir, tmp_path, count, monkeypatch):
    for name in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX", "RANK"):
        monkeypatch.delenv(name, raising=False)
    source = thousand_rows_file(tmp_path / "in.jsonl")
    out = tmp_path / "out.parquet"
    codes = [
        main(
            [
                "generate",
                str(source),
                str(out),
                "--num-shards",
                str(count),
                "--shard-index",
                str(index),
                *shard_args(tiny_llama_dir),
            ]
        )
        for index in range(count)
    ]
    parts = sorted(out.iterdir()) if count > 1 else [out]
    if count > 1:
        assert [p.name for p in parts] == [f"part-{i:05d}-of-{count:05d}.parquet" for i in range(count)]
    per_part = [pq.read_table(p).to_pylist() for p in parts]
    rows = [r for part in per_part for r in part]
    assert sorted(r["id"] for r in rows) == sorted(expected_ids())  # every id once
    errors = {r["id"]: r["error"] for r in rows if r["error"]}
    assert set(errors) == {"q0", "q12", "13"} and "duplicate id 'q0'" in errors["q0"]
    # exit 1 (rows failed) exactly in the shards holding the bad rows; no shard fails for another's rows
    for index, (code, part) in enumerate(zip(codes, per_part)):
        assert code == (1 if any(r["error"] for r in part) else 0)
        assert all(shard_of(r["id"], count) == index for r in part) or count == 1
    whole = pq.read_table(out).to_pylist()  # the directory reads back as one dataset
    assert len(whole) == len(rows)


def test_scheduler_environment_picks_the_shard_and_the_summary_names_it(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    source = thousand_rows_file(tmp_path / "in.jsonl")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    monkeypatch.setenv("COLUMNS", "300")  # the summary table on one line per row
    out = tmp_path / "out-{shard}.jsonl"
    code = main(["generate", str(source), str(out), *[a for a in shard_args(tiny_llama_dir) if a != "-q"]])
    err = capsys.readouterr().err
    assert code in (0, 1), err
    assert "1 of 3 (from SLURM_ARRAY_TASK_ID=2 - SLURM_ARRAY_TASK_MIN=1; SLURM_ARRAY_TASK_COUNT=3)" in " ".join(
        err.split()
    )
    rows = read_jsonl(tmp_path / "out-1.jsonl")
    assert rows and all(shard_of(r["id"], 3) == 1 for r in rows)
    assert "Traceback" not in err


def test_bad_shard_options_are_refused_before_any_work(tiny_llama_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    assert (
        main(
            [
                "generate",
                str(source),
                str(tmp_path / "o.jsonl"),
                "--num-shards",
                "3",
                "--shard-index",
                "3",
                *shard_args(tiny_llama_dir),
            ]
        )
        == 2
    )
    assert "outside 0..2" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_a_killed_shard_resumes_alone_with_no_duplicates_or_gaps(tiny_llama_dir, tmp_path, capsys):
    rows = [{"id": f"k{i}", "prompt": "the quick brown fox " * (1 + i % 3)} for i in range(60)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    mine = sorted(r["id"] for r in rows if shard_of(r["id"], 2) == 1)
    reference = tmp_path / "ref.jsonl"
    assert (
        main(
            [
                "generate",
                str(source),
                str(reference),
                *args(tiny_llama_dir, "-q", "--num-shards", "2", "--shard-index", "1"),
            ]
        )
        == 0
    )
    out = tmp_path / "out.jsonl.d"
    out.mkdir()
    out = out / "out-{shard}.jsonl"
    on_disk = tmp_path / "out.jsonl.d" / "out-1.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cbrun",
            "generate",
            str(source),
            str(out),
            *args(tiny_llama_dir, "--window", "2", "--num-shards", "2", "--shard-index", "1"),
        ],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while complete_lines(on_disk) < 3:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "no rows were written in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert 3 <= complete_lines(on_disk) < len(mine)
    assert (
        main(
            [
                "generate",
                str(source),
                str(out),
                *args(tiny_llama_dir, "-q", "--resume", "--num-shards", "2", "--shard-index", "1"),
            ]
        )
        == 0
    )
    resumed = read_jsonl(on_disk)
    assert sorted(r["id"] for r in resumed) == mine
    expected = {r["id"]: r["completion_token_ids"] for r in read_jsonl(reference / "part-00001-of-00002.jsonl")}
    assert {r["id"]: r["completion_token_ids"] for r in resumed} == expected


def test_a_sharded_json_lines_output_directory_reads_back_as_one_input(tmp_path):
    from cbrun.data.reader import open_input

    directory = tmp_path / "out.jsonl"
    directory.mkdir()
    write_jsonl(directory / "part-00000-of-00002.jsonl", [{"id": "a"}, {"id": "b"}])
    write_jsonl(directory / "part-00001-of-00002.jsonl", [{"id": "c"}])
    (directory / "part-00001-of-00002.jsonl.tmp").write_text("not read\n")
    source = open_input(str(directory))
    assert source.total == 3
    assert [(r.index, r.record["id"]) for r in source] == [(0, "a"), (1, "b"), (2, "c")]
