"""`cbrun generate --ray` on a local Ray cluster (issue 16): same rows as one process, nothing lost on a crash.

Skipped when Ray is not installed (`pip install 'cbrun[ray]'`). One local
cluster serves the module; each engine actor reserves half a CPU and runs one
thread, as the 2-core CI machine needs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_helpers import write_jsonl

from cbrun.cli.app import main

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'cbrun[ray]')")
pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'cbrun[ray]')")

from cbrun.data.reader import RawRow  # noqa: E402
from cbrun.scale.ray_data import CbrunGenerator  # noqa: E402
from cbrun.scale.ray_job import RayProgress, run_ray_job, start_ray  # noqa: E402

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


def prompts() -> list[dict]:
    rows = [{"id": f"r{i}", "prompt": " ".join(WORDS[i % 7 : i % 7 + 2 + i % 6])} for i in range(NUM_ROWS)]
    rows[7] = {"id": "empty", "prompt": ""}  # an error row, not a failed task
    return rows


def engine_args(model_dir) -> list[str]:
    return [
        "-m",
        str(model_dir),
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--num-blocks",
        "256",
        "--page-size",
        "16",
        "--logprobs",
        "-q",
    ]


@pytest.fixture(scope="module")
def local_cluster():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    start_ray(None, threads=1, quiet=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def single_process(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    source = write_jsonl(folder / "in.jsonl", prompts())
    out = folder / "out.parquet"
    assert main(["generate", str(source), str(out), *engine_args(tiny_llama_dir)]) == 1  # the empty prompt
    return source, {r["id"]: r for r in pq.read_table(out).to_pylist()}


def assert_same_rows(rows: list[dict], expected: dict) -> None:
    """Every id once, with bitwise the same tokens and logprobs (the engine is batch-invariant, so
    which replica and which batch a row ran in does not matter)."""
    assert sorted(r["id"] for r in rows) == sorted(expected)
    for row in rows:
        want = expected[row["id"]]
        assert row["completion_token_ids"] == want["completion_token_ids"], row["id"]
        assert (row["finish_reason"], row["error"]) == (want["finish_reason"], want["error"])
        assert row["logprobs"] == want["logprobs"], row["id"]


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_two_replicas_give_the_rows_of_one_process(local_cluster, tiny_llama_dir, single_process, tmp_path):
    source, expected = single_process
    out = tmp_path / "ray.parquet"
    code = main(
        ["generate", str(source), str(out), *engine_args(tiny_llama_dir), "--ray", "--replicas", "2", "--window", "64"]
    )
    assert code == 1  # the empty prompt's error row, as in one process
    parts = sorted(out.iterdir())
    assert len(parts) >= 2 and all(p.name.startswith("part-") for p in parts)  # written block by block
    assert_same_rows(pq.read_table(out).to_pylist(), expected)


class CrashOnce(CbrunGenerator):
    """Kills its actor's process in the middle of the first batch any actor gets (once per marker file)."""

    def __init__(self, crash_marker: str, **kwargs):
        super().__init__(**kwargs)
        self.crash_marker = crash_marker

    def __call__(self, batch):
        try:
            fd = os.open(self.crash_marker, os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return super().__call__(batch)
        os.close(fd)
        os._exit(1)  # as a killed node would: no exception, no cleanup


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_a_replica_killed_mid_batch_is_retried_and_no_row_is_lost_or_doubled(
    local_cluster, tiny_llama_dir, single_process, tmp_path
):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import test modules
    _, expected = single_process
    marker = tmp_path / "crashed"
    rows = [RawRow(i, record) for i, record in enumerate(prompts())]
    written = []
    generator = dict(
        model=str(tiny_llama_dir),
        sampling=dict(max_tokens=8, temperature=0.0),
        logprobs=True,
        engine=dict(num_blocks=256, page_size=16),
        crash_marker=str(marker),
    )
    run_ray_job(
        rows,
        written.append,
        RayProgress(),
        generator=generator,
        replicas=2,
        threads=1,
        cpus_per_replica=0.5,
        window=64,
        udf=CrashOnce,
    )
    assert marker.exists()  # one actor did die
    assert_same_rows([r for table in written for r in table.to_pylist()], expected)


def test_ray_refusals_are_one_line(tiny_llama_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", prompts()[:3])
    out = tmp_path / "out.parquet"
    assert main(["generate", str(source), str(out), *engine_args(tiny_llama_dir), "--ray", "--resume"]) == 2
    assert "--resume does not work with --ray" in capsys.readouterr().err
    assert main(["generate", str(source), str(out), *engine_args(tiny_llama_dir), "--ray", "--replicas", "0"]) == 2
    assert not Path(out).exists()
