"""`cbrun generate --ray` (issue 35) before Ray starts, and its live view: no cluster needed.

Everything --ray can refuse (OUTPUT to stdout, INPUT from stdin, an OUTPUT it
must not touch, a bad runtime_env) is refused in one line with exit code 2
before a Ray process starts. The live view shows rows done, failed and in
flight per replica, tokens/s and the object store's use, and a replica Ray
restarted keeps what its dead process had written.
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import write_jsonl

from cbrun.cli.app import main
from cbrun.cli.common import CliError
from cbrun.cli.ray_run import runtime_env
from cbrun.scale.ray_job import RayProgress, summary
from cbrun.scale.ray_view import ProgressBoard, RayView


@pytest.fixture
def no_ray_start(monkeypatch):
    """Fail the test if --ray gets as far as starting Ray."""

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started: the refusal came too late")

    monkeypatch.setattr("cbrun.scale.ray_job.start_ray", refuse)


def run(args: list[str], capsys) -> tuple[int, str]:
    code = main(["generate", *args, "--max-tokens", "4", "-q"])
    return code, capsys.readouterr().err


def test_what_ray_cannot_do_is_refused_in_one_line_before_ray_starts(tmp_path, capsys, no_ray_start):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    code, err = run([str(source), "-", "--ray"], capsys)
    assert code == 2 and "not -" in err
    code, err = run(["-", str(tmp_path / "o.parquet"), "--ray"], capsys)
    assert code == 2 and "cannot read stdin" in err
    code, err = run([str(source), str(tmp_path / "o.parquet"), "--ray", "--ray-runtime-env", "{not json"], capsys)
    assert code == 2 and "--ray-runtime-env" in err
    local = tmp_path / "local.parquet"
    pq.write_table(pa.table({"id": ["a"]}), local)
    code, err = run([str(source), str(local), "--ray", "--resume"], capsys)
    assert code == 2 and "written without --ray: resume it without --ray" in err
    code, err = run([str(source), str(local), "--ray"], capsys)
    assert code == 2 and "exists (use --resume" in err
    code, err = run([str(source), str(tmp_path / "o.parquet"), "--ray", "--replicas", "0"], capsys)
    assert code == 2 and "--replicas" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_runtime_env_comes_from_json_or_a_file(tmp_path):
    assert runtime_env('{"pip": ["cbrun"]}') == {"pip": ["cbrun"]}
    path = tmp_path / "env.json"
    path.write_text(json.dumps({"env_vars": {"A": "1"}}))
    assert runtime_env(str(path)) == {"env_vars": {"A": "1"}}
    yaml_file = tmp_path / "env.yaml"
    yaml_file.write_text("working_dir: .\nenv_vars:\n  B: '2'\n")
    assert runtime_env(str(yaml_file)) == {"working_dir": ".", "env_vars": {"B": "2"}}
    with pytest.raises(CliError, match="JSON object"):
        runtime_env("[1, 2]")


def test_a_restarted_replica_keeps_what_its_dead_process_wrote():
    board = ProgressBoard()
    snap = dict(done=120, failed=2, in_flight=64, completion_tokens=900, time=1.0)
    board.report("actor-a", "10.0.0.1", {**snap, "pid": 11, "written": 100, "failed_written": 2})
    board.report("actor-b", "10.0.0.2", {**snap, "pid": 12, "written": 120, "failed_written": 2})
    board.report("actor-a", "10.0.0.1", {**snap, "pid": 13, "done": 30, "failed": 0, "written": 0, "failed_written": 0})
    a, b = board.snapshot()
    assert (a["name"], a["done"], a["failed"], a["restarts"]) == ("r0", 130, 2, 1)
    assert (b["name"], b["node"], b["done"], b["in_flight"]) == ("r1", "10.0.0.2", 120, 64)


def test_the_log_lines_say_rows_failed_and_in_flight_per_replica_tokens_and_the_object_store():
    progress = RayProgress(rows_total=1000, rows_done=200, rows_failed=3, completion_tokens=5000, replicas=2)
    view = RayView(progress, None, stream=io.StringIO(), live=False)
    view.replicas = [
        dict(name="r0", node="10.0.0.1", done=250, failed=1, in_flight=64, completion_tokens=4000, restarts=0),
        dict(name="r1", node="10.0.0.2", done=200, failed=2, in_flight=32, completion_tokens=3000, restarts=1),
    ]
    view.store = (12 * 2**20, 4 * 2**30)
    head, first, second = view.lines()
    assert "rows 450/1,000 (45.0%)" in head and "failed 3" in head and "in flight 96" in head
    assert "object store 12 MiB of 4.0 GiB" in head and "2 replicas" in head and "tok/s" in head
    assert "replica r0 on 10.0.0.1: done 250, failed 1, in flight 64" in first
    assert "restarted 1x" in second
    rendered = io.StringIO()
    from rich.console import Console

    Console(file=rendered, width=200).print(view.renderable())
    assert "r1" in rendered.getvalue() and "in flight" in rendered.getvalue()
    assert any("rows 200" in line for line in summary(progress, "out.parquet"))


def test_without_ray_address_ray_init_starts_a_new_local_cluster(monkeypatch):
    """ray.init's own default joins RAY_ADDRESS or the cluster `ray start` (or ray.cluster_utils) last wrote to
    /tmp/ray; cbrun's default is a new local cluster, so a job never lands on another process's cluster."""
    import ray

    from cbrun.scale.ray_job import start_ray

    calls: list[str | None] = []
    monkeypatch.setattr(ray, "init", lambda address=None, **kwargs: calls.append(address))
    start_ray(None, threads=1, quiet=True)
    start_ray("10.0.0.1:6379", threads=1, quiet=True)
    assert calls == ["local", "10.0.0.1:6379"]


def test_ray_address_comes_from_the_flag_then_the_environment(tmp_path, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    seen: list[str | None] = []

    def stop(address, *args, **kwargs):
        seen.append(address)
        raise KeyboardInterrupt  # as far as the test needs to go

    monkeypatch.setattr("cbrun.scale.ray_job.start_ray", stop)
    out = str(tmp_path / "o.parquet")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run([str(source), out, "--ray"], capsys)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")  # as `ray job submit` runs a job on its cluster
    run([str(source), out, "--ray", "--overwrite"], capsys)
    run([str(source), out, "--ray", "--overwrite", "--ray-address", "auto"], capsys)
    assert seen == [None, "10.0.0.2:6379", "auto"]


def test_a_ray_failure_while_reading_the_first_record_is_one_line(tmp_path, capsys, monkeypatch):
    import ray

    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    monkeypatch.setattr("cbrun.scale.ray_job.start_ray", lambda *args, **kwargs: None)

    def raylet_died(unit):
        raise ray.exceptions.LocalRayletDiedError()

    monkeypatch.setattr("cbrun.scale.ray_source.probe_first_record", raylet_died)
    code, err = run([str(source), str(tmp_path / "o.parquet"), "--ray"], capsys)
    assert code == 1 and "the Ray job failed" in err and "--resume finishes the job" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
