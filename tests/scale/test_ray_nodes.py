"""`cbrun generate --ray --ray-address` on a simulated 3-node Ray cluster (issue 35).

`ray.cluster_utils.Cluster` starts a head and two more nodes on this machine,
each with its own raylet and one CPU, as `ray start --head` and `ray start
--address` would on three machines. Each actor reserves a whole node's CPU, so
the three replicas land on three nodes and nothing is left for Ray's own tasks:
the job must still read, count, write and finish (read tasks reserve no CPU).
"""

from __future__ import annotations

import json

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from cli_helpers import write_jsonl

from cbrun.cli.app import main

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'cbrun[ray]')")
pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'cbrun[ray]')")

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


@pytest.fixture
def three_nodes():
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow  # three raylets and a job: the full suite only
def test_a_three_node_cluster_runs_one_replica_per_node_with_the_rows_of_one_process(
    three_nodes, tiny_llama_dir, tmp_path
):
    rows = [{"id": f"n{i}", "prompt": " ".join(WORDS[i % 9 : i % 9 + 2 + i % 4])} for i in range(720)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["-m", str(tiny_llama_dir), "--max-tokens", "24", "--temperature", "0", "--num-blocks", "256", "-q"]
    assert main(["generate", str(source), str(tmp_path / "one.parquet"), *args]) == 0
    out = tmp_path / "ray.parquet"
    cluster = ["--ray", "--ray-address", three_nodes.address, "--replicas", "3", "--cpus-per-replica", "1"]
    env = json.dumps({"env_vars": {"CBRUN_TEST_MARK": "3-nodes"}})
    assert main(["generate", str(source), str(out), *args, *cluster, "--window", "30", "--ray-runtime-env", env]) == 0
    expected = {r["id"]: r["completion_token_ids"] for r in pq.read_table(tmp_path / "one.parquet").to_pylist()}
    written = pads.dataset(out, format="parquet").to_table().to_pylist()
    assert sorted(r["id"] for r in written) == sorted(expected)
    assert all(r["completion_token_ids"] == expected[r["id"]] for r in written)
    nodes = {pq.read_schema(m).metadata[b"cbrun"] for m in (out / ".cbrun" / "manifests").iterdir()}
    # each replica reserves a whole 1-CPU node, so the three sit on three nodes; which of them get blocks is
    # Ray's choice (the first one ready takes two units at once), so at least two nodes wrote to OUTPUT
    assert len({json.loads(n)["node"] for n in nodes}) >= 2
    assert len([n for n in ray.nodes() if n["Alive"]]) == 3
