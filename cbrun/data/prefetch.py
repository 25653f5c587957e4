"""The job's input side: rows read on their own thread into a bounded queue.

Why a thread: the job's loop both submits rows and writes results. Reading
the input in that loop would let a slow producer (stdin at the end of a
pipeline, a network file) hold back every finished result until its next line
came; on a thread, results are written as they finish and each row is
submitted as soon as it arrives. Why a bounded queue: the reader stays at
most `maxsize` rows ahead of the job, so memory does not grow with the input.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

from cbrun.data.reader import InputError, RawRow

CLOSE_POLL_SECONDS = 0.1  # how soon a reader blocked on a full queue sees close()

_END = object()


class RowPrefetcher:
    """Reads input rows on a daemon thread into a queue of at most `maxsize` rows.

    `take` hands rows to the job's thread; an error while reading (I/O,
    decoding) is raised by `take`, in that thread, as InputError.
    `close` stops the thread whether or not the input was read to its end.
    """

    def __init__(self, rows: Iterable[RawRow], maxsize: int):
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._closed = threading.Event()
        self.exhausted = False
        self._thread = threading.Thread(target=self._run, args=(iter(rows),), name="cbrun-reader", daemon=True)
        self._thread.start()

    def _run(self, rows: Iterator[RawRow]) -> None:
        try:
            for row in rows:
                if not self._put(row):
                    return
        except Exception as exc:  # an I/O error mid-input: reported by take()
            self._put(exc)
            return
        self._put(_END)

    def _put(self, item: object) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=CLOSE_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def take(self, limit: int, timeout: float) -> list[RawRow]:
        """Up to `limit` rows: waits up to `timeout` for the first, then takes what is ready."""
        rows: list[RawRow] = []
        while len(rows) < limit and not self.exhausted:
            try:
                item = self._queue.get(timeout=timeout) if not rows and timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _END:
                self.exhausted = True
            elif isinstance(item, Exception):
                self.exhausted = True
                raise InputError(f"reading input failed: {item}") from item
            else:
                rows.append(item)
        return rows

    def close(self) -> None:
        self._closed.set()
