"""Where the chunks of streamed requests go: a queue read by `Engine.stream`, or a caller's sink.

The engine's loop thread puts each chunk (one per token, and one last chunk
per sample with its finish reason and whole result); a request added with
`stream=True` is read from its queue in the caller's thread, one added with
`on_chunk` has each chunk handed to that function on the loop thread (AsyncLLM
passes them on to its event loop).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

from cbrun.engine.request import StreamChunk

Sink = Callable[[StreamChunk], None]


class Streams:
    """Per request id: its chunk queue or sink, and how many of its samples have not ended."""

    def __init__(self) -> None:
        self._queues: dict[str, queue.Queue[StreamChunk]] = {}
        self._sinks: dict[str, Sink] = {}
        self._open: dict[str, int] = {}  # id -> samples not ended, for sinks (a queue's reader counts its own)
        self._samples: dict[str, int] = {}

    def open(self, request_id: str, samples: int, sink: Sink | None = None) -> None:
        """Before the request is submitted: a sink, or a queue for `read`."""
        if sink is not None:
            self._sinks[request_id] = sink
            self._open[request_id] = samples
        elif request_id not in self._queues:
            self._queues[request_id] = queue.Queue()
            self._samples[request_id] = samples

    def put(self, chunk: StreamChunk) -> None:
        """A chunk to its request's sink or queue (loop thread)."""
        rid = chunk.request_id
        sink = self._sinks.get(rid)
        if sink is None:
            self._queues[rid].put(chunk)
            return
        if chunk.finish_reason is not None:
            self._open[rid] -= 1
            if not self._open[rid]:
                del self._sinks[rid], self._open[rid]
        sink(chunk)

    def read(self, request_id: str) -> Iterator[StreamChunk]:
        """The chunks of a request opened without a sink, in order, until each sample's last."""
        chunks = self._queues.get(request_id)
        if chunks is None:
            raise KeyError(f"request {request_id!r} was not added with stream=True")
        remaining = self._samples[request_id]
        while remaining:
            chunk = chunks.get()
            if chunk.finish_reason is not None:
                remaining -= 1
            yield chunk
        self._queues.pop(request_id, None)
        self._samples.pop(request_id, None)
