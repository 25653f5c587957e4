"""Measure `cbrun generate --ray` past one machine (issue 35): driver memory, replicas, faults.

    python scripts/ray_scale.py memory --rows 10000 100000 1000000     # driver peak RSS per input size
    python scripts/ray_scale.py throughput --replicas 1 2 4 --nodes 2   # rows/s on a simulated cluster
    python scripts/ray_scale.py chaos --rows 1000000                    # 2 actor kills, 1 driver kill, --resume
    python scripts/ray_scale.py bitwise --rows 64 --dtype bfloat16      # SmolLM2: --ray after kills == one process

Every job runs the fake engine (tests/fake_engine.py: results at once, deterministic with a seed), so what
is measured is cbrun's and Ray's own work: planning, reading, parsing, prefix-sorted submission, part and
manifest writes, the driver's counting. `--model DIR` runs a real model instead (throughput). Each job's
driver is a child process (`drive`), so its peak RSS is its own; inputs are cached in --work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
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
    "and",
    "values",
]
SAMPLING = dict(max_tokens=8, temperature=0.0, seed=0)


def make_input(rows: int, work: Path) -> Path:
    """`rows` JSON lines with ids and short prompts sharing prefixes (written once, then reused)."""
    path = work / f"in-{rows}.jsonl"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for i in range(rows):
                words = WORDS[i % 7 : i % 7 + 3 + i % 5]
                f.write(json.dumps({"id": f"r{i}", "prompt": f"{' '.join(words)} {i}"}) + "\n")
        tmp.rename(path)
    return path


# --- the driver (a child process) ---------------------------------------------------------------


def drive(args: argparse.Namespace) -> None:
    """One job's driver: prints one JSON line (rows, seconds, peak RSS, OUTPUT check)."""
    from ray_fakes import FakeEngineWriter, ship_by_value

    from cbrun.data.generate.format import CbrunFormat
    from cbrun.scale.input_plan import plan_input
    from cbrun.scale.part_store import PartStore
    from cbrun.scale.part_writer import PartWriter
    from cbrun.scale.ray_job import RayJob, RayProgress, default_cpus, run_to_output, start_ray

    start_ray(args.address, threads=1, quiet=True)
    ship_by_value()
    started = time.perf_counter()
    plan = plan_input(args.input, parallelism=args.replicas * 8)
    store = PartStore(Path(args.output), "parquet", run=f"run-{os.getpid()}")
    cpus = args.cpus or default_cpus(1, args.replicas, args.address is None)
    model = args.model or "fake"
    sampling = dict(SAMPLING)
    job = RayJob(
        plan=plan,
        store=store,
        fmt=CbrunFormat(),
        generator=dict(model=model, sampling=sampling),
        replicas=args.replicas,
        threads=1,
        cpus_per_replica=cpus,
        window=args.window,
    )
    if args.kill_actors:
        threading.Thread(target=_kill_actors, args=(store, args.kill_actors), daemon=True).start()
    if args.die_at:
        threading.Thread(target=_die_at, args=(store, args.die_at * (plan_rows(plan) or 0)), daemon=True).start()
    progress = RayProgress()
    udf = PartWriter if args.model else FakeEngineWriter
    run_to_output(job, progress, resume=args.resume, overwrite=not args.resume, view=False, udf=udf)
    seconds = time.perf_counter() - started
    steady = _steady_rate(store) if not args.resume else None
    result = {
        "rows": progress.rows_total,
        "rows_this_run": progress.rows_done - progress.rows_skipped,
        "seconds": round(seconds, 1),
        "rows_per_s": round((progress.rows_done - progress.rows_skipped) / seconds, 1),
        "steady_rows_per_s": steady,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "missing": progress.missing_rows,
        "doubled": progress.doubled_rows,
        "duplicate_ids": progress.duplicates.count if progress.duplicates else 0,
        "retried_blocks": progress.retried_blocks,
        "replicas": args.replicas,
    }
    print(json.dumps(result), flush=True)


def _steady_rate(store) -> float | None:
    """Rows/s between the first and the last part written (start-up and model loads left out)."""
    from cbrun.scale.part_store import read_manifest_meta

    written = sorted((m.stat().st_mtime, read_manifest_meta(m)["rows"]) for m in store.manifests.glob("*.manifest"))
    if len(written) < 3:
        return None
    span = written[-1][0] - written[0][0]
    return round(sum(rows for _, rows in written[1:]) / span, 1) if span > 0 else None


def plan_rows(plan) -> int | None:
    """The input's rows (JSON Lines plans are counted when the job starts: count the lines here)."""
    with open(plan.name, "rb") as f:
        return sum(1 for _ in f)


def _die_at(store, rows: float) -> None:
    """SIGKILL this driver and the local Ray cluster it started (its session) once `rows` rows are written."""
    from cbrun.scale.part_store import read_manifest_meta

    seen: set[str] = set()
    written = 0
    while written < rows:
        time.sleep(0.5)
        for manifest in store.manifests.glob("*.manifest"):
            if manifest.name not in seen:
                seen.add(manifest.name)
                written += read_manifest_meta(manifest)["rows"]
    print(json.dumps({"driver_killed_at_rows": written}), file=sys.stderr, flush=True)
    os.killpg(0, signal.SIGKILL)


def _kill_actors(store, count: int) -> None:
    """SIGKILL an engine actor's process `count` times, once every few dozen blocks written."""
    import psutil

    for kill in range(count):
        while len(list(store.manifests.glob("*.manifest"))) < 20 * (kill + 1):
            time.sleep(0.2)
        actors = [
            p for p in psutil.process_iter(["name", "cmdline"]) if "MapWorker" in " ".join(p.info["cmdline"] or [])
        ]
        if actors:
            actors[0].kill()
            print(json.dumps({"killed_actor": actors[0].pid}), file=sys.stderr, flush=True)


def run_driver(args: list[str], timeout: float = 3600, kill_when=None) -> dict | None:
    """Run `drive` in a child process (its own session); `kill_when()` true: SIGKILL the whole session."""
    command = [sys.executable, __file__, "drive", *args]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True, text=True)
    deadline = time.monotonic() + timeout
    while child.poll() is None:
        if kill_when is not None and kill_when():
            os.killpg(child.pid, signal.SIGKILL)  # the driver and the local cluster it started
            child.wait()
            return None
        if time.monotonic() > deadline:
            os.killpg(child.pid, signal.SIGKILL)
            raise TimeoutError(" ".join(command))
        time.sleep(0.2)
    out = child.stdout.read() if child.stdout else ""
    if child.returncode == -signal.SIGKILL:
        return None  # killed on purpose (--die-at)
    if child.returncode:
        raise RuntimeError(f"driver failed ({child.returncode}): {' '.join(command)}")
    return json.loads(out.strip().splitlines()[-1])


# --- the measurements ------------------------------------------------------------------------------


def memory(args: argparse.Namespace) -> None:
    print("| input rows | driver peak RSS | wall | rows/s |\n|---:|---:|---:|---:|")
    for rows in args.rows:
        source = make_input(rows, args.work)
        out = args.work / f"out-memory-{rows}.parquet"
        r = run_driver(["--input", str(source), "--output", str(out), "--replicas", str(args.replicas)])
        assert r is not None and r["missing"] == r["doubled"] == 0, r
        print(f"| {rows:,} | {r['peak_rss_mb']:.0f} MB | {r['seconds']:.0f} s | {r['rows_per_s']:,.0f} |", flush=True)


def throughput(args: argparse.Namespace) -> None:
    """A simulated cluster (ray.cluster_utils.Cluster): --nodes raylets on this machine; drivers join it."""
    from ray.cluster_utils import Cluster

    source = make_input(args.rows[0], args.work)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.cpus_per_node, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=args.cpus_per_node)
    cluster.wait_for_nodes()
    try:
        print(
            f"| replicas | rows/s, whole job | rows/s, first part to last | wall ({args.rows[0]:,} rows, "
            f"{args.nodes} nodes, {args.model or 'fake engine'}) |\n|---:|---:|---:|---:|"
        )
        for replicas in args.replicas:
            out = args.work / f"out-throughput-{replicas}.parquet"
            extra = ["--model", args.model] if args.model else []
            r = run_driver(
                [
                    "--input",
                    str(source),
                    "--output",
                    str(out),
                    "--replicas",
                    str(replicas),
                    "--address",
                    cluster.address,
                ]
                + ["--cpus", str(args.cpus_per_replica), *extra]
            )
            assert r is not None and r["missing"] == r["doubled"] == 0, r
            steady = f"{r['steady_rows_per_s']:,.0f}" if r["steady_rows_per_s"] else "n/a"
            print(f"| {replicas} | {r['rows_per_s']:,.0f} | {steady} | {r['seconds']:.0f} s |", flush=True)
    finally:
        cluster.shutdown()


def chaos(args: argparse.Namespace) -> None:
    """Run 1 with two actor kills, killed itself (driver and local cluster) at ~60% of blocks; run 2 resumes.
    Then every input id must be in OUTPUT exactly once, each row as one process computes it."""
    rows = args.rows[0]
    source = make_input(rows, args.work)
    out = args.work / f"out-chaos-{rows}.parquet"
    common = ["--input", str(source), "--output", str(out), "--replicas", str(args.replicas)]

    first = run_driver([*common, "--kill-actors", "2", "--die-at", "0.6"])
    print(f"run 1: {'killed' if first is None else 'finished before the kill'}", flush=True)
    second = run_driver([*common, "--resume"])
    print(f"run 2 (--resume): {second}", flush=True)
    print(verify(source, out), flush=True)


def bitwise(args: argparse.Namespace) -> None:
    """`cbrun generate` once in one process and once with --ray, whose run loses an actor and then its driver
    (killed with its local cluster) and is finished by --resume: token ids and logprobs must be equal bitwise."""
    import psutil
    import pyarrow.dataset as pads

    rows = args.rows[0]
    source = args.work / f"chat-{rows}.jsonl"
    with open(source, "w") as f:
        for i in range(rows):
            question = f"In one sentence, what is {' '.join(WORDS[i % 9 : i % 9 + 2])} number {i}?"
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": question}]}) + "\n")
    model = ["-m", args.model] if args.model else []
    common = [*model, "--dtype", args.dtype, "--max-tokens", "16", "--temperature", "0", "--logprobs", "-q"]
    cbrun = [sys.executable, "-m", "cbrun", "generate", str(source)]
    one, out = args.work / f"one-{args.dtype}.parquet", args.work / f"ray-{args.dtype}.parquet"
    subprocess.run([*cbrun, str(one), *common, "--overwrite"], check=True, cwd=REPO)
    ray_args = ["--ray", "--replicas", str(args.replicas), "--window", "8"]
    manifests = out / ".cbrun" / "manifests"

    def written() -> int:
        return len(list(manifests.glob("*.manifest"))) if manifests.exists() else 0

    driver = subprocess.Popen([*cbrun, str(out), *common, *ray_args, "--overwrite"], cwd=REPO, start_new_session=True)
    while written() < 1:
        time.sleep(0.2)
    actor = next(p for p in psutil.process_iter(["cmdline"]) if "MapWorker" in " ".join(p.info["cmdline"] or []))
    actor.kill()
    while written() < 4 and driver.poll() is None:
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    print(f"{args.dtype}: an actor killed, then the driver with {written()} parts written", flush=True)
    subprocess.run([*cbrun, str(out), *common, *ray_args, "--resume"], cwd=REPO)
    columns = ["id", "completion_token_ids", "logprobs", "error"]
    expected = {r["id"]: r for r in pads.dataset(one).to_table(columns=columns).to_pylist()}
    got = pads.dataset(out, format="parquet").to_table(columns=columns).to_pylist()
    ids = [r["id"] for r in got]
    differ = sum(1 for r in got if r != expected.get(r["id"]))
    print(
        f"{args.dtype}: {len(got)} rows, missing {len(set(expected) - set(ids))}, duplicated "
        f"{len(ids) - len(set(ids))}, rows not bitwise equal to one process {differ}",
        flush=True,
    )


def verify(source: Path, out: Path) -> str:
    """Missing and duplicated ids in OUTPUT, and rows that differ from one process (the fake engine's rows)."""
    import pyarrow.dataset as pads
    from fake_engine import FakeEngine, FakeTokenizer

    from cbrun.data.generate.format import CbrunFormat
    from cbrun.data.generate.preparer import GeneratePreparer
    from cbrun.data.generate.row_kind import GenerateRows
    from cbrun.data.job import Job
    from cbrun.data.reader import open_input
    from cbrun.engine.sampling_params import SamplingParams

    table = pads.dataset(out, format="parquet").to_table(columns=["id", "completion_token_ids"])
    ids = table.column("id").to_pylist()
    seen = collections.Counter(ids)
    with open(source, "rb") as f:
        expected_ids = {f"r{i}" for i in range(sum(1 for _ in f))}
    missing = len(expected_ids - seen.keys())
    duplicated = sum(1 for count in seen.values() if count > 1)

    class Sink:  # the one-process rows, kept as id -> token ids
        def __init__(self) -> None:
            self.rows: dict = {}

        def write(self, row: dict) -> None:
            self.rows[row["id"]] = row["completion_token_ids"]

        def maybe_flush(self) -> None: ...

        def flush(self) -> None: ...

    engine, sink = FakeEngine(record_submitted=False), Sink()
    preparer = GeneratePreparer(
        FakeTokenizer(), SamplingParams(**SAMPLING), max_context=engine.max_context, vocab_size=engine.vocab_size
    )
    Job(engine, open_input(str(source)), preparer, CbrunFormat(), sink, kind=GenerateRows()).run()
    tokens = table.column("completion_token_ids").to_pylist()
    differ = sum(1 for row_id, got in zip(ids, tokens) if sink.rows.get(row_id) != got)
    return (
        f"OUTPUT: {len(ids):,} rows; missing ids {missing}, duplicated ids {duplicated}, "
        f"rows unlike one process {differ}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["memory", "throughput", "chaos", "bitwise", "drive"])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=float, default=2)
    parser.add_argument("--cpus-per-replica", type=float, default=0.5)
    parser.add_argument(
        "--model",
        default=None,
        help="a model for the engine (default: the fake engine; bitwise: cbrun's default model)",
    )
    parser.add_argument("--dtype", default="float32", help="bitwise: the model's dtype")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cbrun-ray-scale"))
    # drive only
    parser.add_argument("--input")
    parser.add_argument("--output")
    parser.add_argument("--address", default=None)
    parser.add_argument("--cpus", type=float, default=None)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-actors", type=int, default=0)
    parser.add_argument("--die-at", type=float, default=0.0, help="drive: kill the driver at this fraction of rows")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.what == "drive":
        args.replicas = args.replicas[0]
        drive(args)
    else:
        {"memory": memory, "throughput": throughput, "chaos": chaos, "bitwise": bitwise}[args.what](
            argparse.Namespace(
                **{**vars(args), "replicas": args.replicas if args.what == "throughput" else args.replicas[0]}
            )
        )


if __name__ == "__main__":
    main()
