"""The actor of `cbrun generate --ray`: a block of input rows in, a part file and its manifest out.

`PartWriter` is a `CbrunGenerator` (one engine per actor, the CLI's rows) that
writes its results itself, so the driver never touches result rows: Ray Data
gets back one row of counters per block. The same block always gets the same
part name (`BlockKey`), so Ray's retry of a block whose worker died
overwrites its own part.

A block whose worker died (a kill, a lost node, or Ray's memory monitor) is
run again in smaller pieces: attempt N cuts the block into up to 8^(N-1)
pieces, each written as its own part as soon as it is done, and pieces written
by an earlier attempt are skipped. A row that kills its worker even alone, three
times, is written as an error row instead of being retried for ever, so an
over-large row shows up in the output instead of hanging the job.

The live view's counters go to a `ProgressBoard` actor once a second.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import fields
from typing import Any

from cbrun.data.generate.format import CbrunFormat
from cbrun.data.job import JobProgress
from cbrun.data.reader import RawRow
from cbrun.data.rows import BadRow
from cbrun.scale.part_store import BlockCounters, BlockKey, PartStore
from cbrun.scale.ray_data import CbrunGenerator, raw_rows
from cbrun.scale.shards import row_id_of

DEPTH_PER_RETRY = 3  # each retry of a block cuts its pieces 8 times smaller
MAX_ROW_ATTEMPTS = 3  # a row alone in its piece kills its worker this often: it becomes an error row
REPORT_SECONDS = 1.0
GIVE_UP = "not generated: the Ray worker running this row died {n} times while it ran alone (out of memory?)"


class PartWriter(CbrunGenerator):
    """`CbrunGenerator` that writes each block to OUTPUT (see `cbrun.scale.part_store`).

    output, output_kind, run: OUTPUT's directory, "parquet" or "jsonl", and this run's token.
    board: a ProgressBoard actor handle for the live view (None: no reports).
    Other keyword arguments: as CbrunGenerator.
    """

    def __init__(self, *, output: str, output_kind: str, run: str = "", board: Any = None, **generator: Any):
        super().__init__(**generator)
        self.store = PartStore(output, output_kind, run)
        self.store.node = _node_id()
        self.store.manifests.mkdir(parents=True, exist_ok=True)  # the driver made it; not so when used alone
        self.live = _LiveCounters()
        if board is not None:
            threading.Thread(target=_report_loop, args=(board, self.live), name="cbrun-report", daemon=True).start()

    def __call__(self, batch: Any) -> Any:  # pyarrow Table in, pyarrow Table (one row of counters) out
        import pyarrow as pa

        rows = sorted(raw_rows(batch), key=lambda r: r.index)
        total = BlockCounters()
        if rows:
            key = BlockKey(rows[0].index, rows[-1].index)
            attempt = self.store.begin_attempt(key)
            complete = self.store.counters_of(key) is not None  # Ray ran it again after it was written
            self.live.start_block(len(rows))
            self._visit(rows, DEPTH_PER_RETRY * (attempt - 1), attempt, total)
            total.retried = int(attempt > 1 and not complete)
            # the attempt markers stay until the run ends: if Ray runs this block again (a lost result), the
            # next attempt cuts at least as fine as this one, so it finds every piece this one wrote
        return pa.table({f.name: [getattr(total, f.name)] for f in fields(total)})

    def _visit(self, rows: list[RawRow], depth: int, block_attempt: int, total: BlockCounters) -> None:
        """Write `rows` as one piece, or as the pieces `depth` halvings make; skip what is already written."""
        key = BlockKey(rows[0].index, rows[-1].index)
        written = self.store.counters_of(key)
        if written is not None:  # an earlier attempt of this block wrote it, then died
            total.add(written)
            self.live.skip(written)
            return
        # a part without its manifest: a worker died between the two renames; its rows go elsewhere now
        self.store.part_path(key).unlink(missing_ok=True)
        if depth > 0 and len(rows) > 1:
            middle = len(rows) // 2
            self._visit(rows[:middle], depth - 1, block_attempt, total)
            self._visit(rows[middle:], depth - 1, block_attempt, total)
            return
        tries = 0  # times this row has been started alone (after its block's worker died)
        if len(rows) == 1 and block_attempt > 1:
            is_block = depth == DEPTH_PER_RETRY * (block_attempt - 1)  # the block itself is this one row
            tries = block_attempt if is_block else self.store.begin_attempt(key)
        total.add(self._write_piece(rows, key, give_up=tries > MAX_ROW_ATTEMPTS))

    def _write_piece(self, rows: list[RawRow], key: BlockKey, give_up: bool) -> BlockCounters:
        progress = JobProgress()
        self.live.current = progress
        if give_up:
            out = [self.fmt.bad_row(_given_up(rows[0], self.fmt, MAX_ROW_ATTEMPTS))]
            counters = BlockCounters(rows=1, failed=1, samples=1, given_up=1)
        else:
            out = self.generate_rows(rows, progress)
            counters = BlockCounters(
                rows=progress.rows_done,
                failed=progress.rows_failed,
                samples=progress.samples_written,
                prompt_tokens=progress.prompt_tokens,
                completion_tokens=progress.completion_tokens,
            )
        self.store.write_part(key, part_table(out, self.fmt) if self.store.kind == "parquet" else out)
        self.store.write_manifest(key, [r.index for r in rows], [row_id_of(r) for r in rows], counters)
        self.live.finish_piece(counters)
        return counters


def _given_up(raw: RawRow, fmt: CbrunFormat, attempts: int) -> BadRow:
    keep = {name: (raw.record or {}).get(name) for name in fmt.keep_columns}
    return BadRow(raw.index, row_id_of(raw), f"{raw.where}: {GIVE_UP.format(n=attempts)}", keep)


def part_table(rows: list[dict], fmt: CbrunFormat) -> Any:  # a pyarrow.Table
    """A part's rows in the cbrun schema. The structured column is there when the job has a constraint or a
    row of this part has one; kept columns take the type their values share (null when all are null) or
    become JSON text. Parts that disagree are brought to one schema when the job ends (`finalize_parts`)."""
    import pyarrow as pa

    if not fmt.structured and any("structured" in r for r in rows):
        fmt = dataclasses.replace(fmt, structured=True)
    keep_types = {}
    for name in fmt.keep_columns:
        try:
            keep_types[name] = pa.array([r.get(name) for r in rows]).type
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            keep_types[name] = pa.string()
            for r in rows:
                value = r.get(name)
                r[name] = value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return pa.Table.from_pylist(rows, schema=fmt.arrow_schema(keep_types))


class _LiveCounters:
    """This actor's counters since it started, read by the report thread (plain ints: no lock needed)."""

    def __init__(self) -> None:
        self.done = BlockCounters()
        self.current: JobProgress | None = None
        self.block_left = 0  # rows of the current block not yet written, before the current piece's progress
        self.pid = os.getpid()

    def start_block(self, rows: int) -> None:
        self.block_left = rows

    def skip(self, counters: BlockCounters) -> None:
        self.block_left -= counters.rows

    def finish_piece(self, counters: BlockCounters) -> None:
        self.done.add(counters)
        self.block_left -= counters.rows
        self.current = None

    def snapshot(self) -> dict:
        current = self.current
        running = current.rows_done if current is not None else 0
        return {
            "pid": self.pid,
            "done": self.done.rows + running,
            "failed": self.done.failed + (current.rows_failed if current is not None else 0),
            "in_flight": max(0, self.block_left - running),
            "completion_tokens": self.done.completion_tokens + (current.completion_tokens if current else 0),
            "written": self.done.rows,  # what a restart of this replica must not lose from the view
            "failed_written": self.done.failed,
            "completion_tokens_written": self.done.completion_tokens,
            "time": time.time(),
        }


def _node_id() -> str:
    """The Ray node this actor runs on ("" outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # Ray missing or not in a worker
        return ""


def _report_loop(board: Any, live: _LiveCounters) -> None:
    """Send this actor's counters to the board every REPORT_SECONDS, for as long as the actor lives."""
    import ray

    context = ray.get_runtime_context()
    replica = context.get_actor_id() or f"pid-{live.pid}"
    node = ray.util.get_node_ip_address()
    while True:
        board.report.remote(replica, node, live.snapshot())
        time.sleep(REPORT_SECONDS)
