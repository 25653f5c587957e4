"""The live view of a `cbrun generate --ray` job, from counters the actors report.

    actors --(once a second: rows done, failed, in flight, tokens)--> ProgressBoard (a tiny actor)
    driver --(every refresh)--> board.snapshot() + Ray's object store use --> rich table or log lines

The job's own totals (`RayProgress`) come from the blocks' counters as Ray Data
delivers them, which is exact but arrives a block at a time; the board says
what each replica is doing now. On a terminal the view is a rich Live table;
otherwise (logs of batch jobs) a line for the job and one per replica every
`interval` seconds. A replica Ray restarted keeps its row: the new process's
counters are added to what the dead one had written.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any, TextIO

MAX_REPLICA_LINES = 8


class ProgressBoard:
    """Counters per replica (run as a Ray actor with num_cpus=0; `ray.remote(ProgressBoard)`)."""

    def __init__(self) -> None:
        self._replicas: dict[str, dict] = {}

    def report(self, replica: str, node: str, snapshot: dict) -> None:
        entry = self._replicas.get(replica)
        if entry is None:
            entry = self._replicas[replica] = {
                "node": node,
                "pid": snapshot["pid"],
                "base": {},
                "last": {},
                "restarts": 0,
            }
        if snapshot["pid"] != entry["pid"]:  # Ray restarted this replica: keep what the dead process wrote
            last = entry["last"]
            for name in ("written", "failed_written", "completion_tokens_written"):
                entry["base"][name] = entry["base"].get(name, 0) + last.get(name, 0)
            entry.update(pid=snapshot["pid"], restarts=entry["restarts"] + 1)
        entry["node"] = node
        entry["last"] = snapshot

    def snapshot(self) -> list[dict]:
        """One dict per replica, in the order they first reported: name, node, done, failed, in_flight,
        completion_tokens, restarts, time (of its last report)."""
        out = []
        for number, entry in enumerate(self._replicas.values()):
            last, base = entry["last"], entry["base"]
            out.append(
                {
                    "name": f"r{number}",
                    "node": entry["node"],
                    "done": base.get("written", 0) + last.get("done", 0),
                    "failed": base.get("failed_written", 0) + last.get("failed", 0),
                    "in_flight": last.get("in_flight", 0),
                    "completion_tokens": base.get("completion_tokens_written", 0) + last.get("completion_tokens", 0),
                    "restarts": entry["restarts"],
                    "time": last.get("time", 0.0),
                }
            )
        return out


def object_store_use() -> tuple[float, float] | None:
    """(bytes used, bytes in all) of Ray's object store across the cluster, or None if Ray cannot say."""
    try:
        import ray

        capacity = ray.cluster_resources().get("object_store_memory")
        free = ray.available_resources().get("object_store_memory", 0.0)
    except Exception:  # a cluster going down must not kill the view
        return None
    if not capacity:
        return None
    return max(0.0, capacity - free), capacity


class RayView:
    """The live view (a context manager): a thread that polls the board and prints, or a rich Live table.

    progress: the job's RayProgress (read only). board: the ProgressBoard actor handle (None: totals only).
    live: force the rich view on or off (None: when the stream is a terminal).
    """

    def __init__(
        self,
        progress: Any,
        board: Any = None,
        *,
        interval: float = 5.0,
        stream: TextIO | None = None,
        live: bool | None = None,
    ):
        self.progress = progress
        self.board = board
        self.interval = interval
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.replicas: list[dict] = []
        self.store: tuple[float, float] | None = None
        self._rates: dict[str, float] = {}
        self._previous: dict[str, tuple[float, int]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cbrun-ray-view", daemon=True)

    def __enter__(self) -> RayView:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def poll(self) -> None:
        """Fetch the replicas' counters and the object store's use (keeps the last answer on failure)."""
        if self.board is not None:
            with contextlib.suppress(Exception):
                import ray

                self.replicas = ray.get(self.board.snapshot.remote(), timeout=5)
        self.store = object_store_use() or self.store
        now = time.perf_counter()
        for replica in self.replicas:
            then, tokens = self._previous.get(replica["name"], (now, replica["completion_tokens"]))
            if now > then:
                self._rates[replica["name"]] = (replica["completion_tokens"] - tokens) / (now - then)
            self._previous[replica["name"]] = (now, replica["completion_tokens"])

    def lines(self) -> list[str]:
        """The job's line, then one line per replica (the first MAX_REPLICA_LINES)."""
        p = self.progress
        # the job's own count moves a whole read unit at a time; the replicas' reports move every second
        done = min(max(p.rows_done, p.rows_skipped + sum(r["done"] for r in self.replicas)), p.rows_total or 1 << 62)
        total = f"/{p.rows_total:,}" if p.rows_total else ""
        percent = f" ({100 * done / p.rows_total:.1f}%)" if p.rows_total else ""
        in_flight = sum(r["in_flight"] for r in self.replicas)
        now_rate = sum(self._rates.values())
        overall = p.completion_tokens / max(p.elapsed_s, 1e-9)
        head = (
            f"[cbrun generate --ray] rows {done:,}{total}{percent} | failed {p.rows_failed:,} | "
            f"in flight {in_flight:,} | {p.replicas} replicas | "
            f"out {now_rate:,.0f} tok/s now, {overall:,.0f} overall | "
            f"object store {_store_text(self.store)} | {p.elapsed_s:,.0f} s"
        )
        out = [head]
        for replica in self.replicas[:MAX_REPLICA_LINES]:
            restarts = f", restarted {replica['restarts']}x" if replica["restarts"] else ""
            out.append(
                f"  replica {replica['name']} on {replica['node']}: done {replica['done']:,}, "
                f"failed {replica['failed']:,}, in flight {replica['in_flight']:,}, "
                f"{self._rates.get(replica['name'], 0.0):,.0f} tok/s{restarts}"
            )
        if len(self.replicas) > MAX_REPLICA_LINES:
            out.append(f"  ... and {len(self.replicas) - MAX_REPLICA_LINES} more replicas")
        return out

    def renderable(self) -> Any:
        """The terminal view: the job's line and a table of replicas."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(show_edge=False, pad_edge=False, box=None)
        for name in ("replica", "node", "done", "failed", "in flight", "tok/s", "restarts"):
            table.add_column(name, justify="left" if name in ("replica", "node") else "right")
        for r in self.replicas:
            table.add_row(
                r["name"],
                r["node"],
                f"{r['done']:,}",
                f"{r['failed']:,}",
                f"{r['in_flight']:,}",
                f"{self._rates.get(r['name'], 0.0):,.0f}",
                str(r["restarts"]),
            )
        return Group(Text(self.lines()[0]), table)

    def _run(self) -> None:
        if not self.live:
            while not self._stopped.wait(self.interval):
                self.poll()
                print("\n".join(self.lines()), file=self.stream, flush=True)
            return
        from rich.console import Console
        from rich.live import Live

        console = Console(file=self.stream, force_terminal=True)
        self.poll()
        with Live(self.renderable(), console=console, refresh_per_second=2, transient=False) as live:
            while not self._stopped.wait(1.0):
                self.poll()
                live.update(self.renderable())


def _store_text(store: tuple[float, float] | None) -> str:
    if store is None:
        return "n/a"
    used, capacity = store
    return f"{used / 2**20:,.0f} MiB of {capacity / 2**30:,.1f} GiB"
