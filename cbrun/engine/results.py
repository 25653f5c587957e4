"""Finished results waiting to be collected, by request id or in completion order."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import overload

from cbrun.engine.request import GenerationOutput


class ResultStore:
    """Thread-safe mailbox of finished outputs.

    Results of streamed requests end their stream and are not queued here;
    everything else is returned exactly once, by `get(id)` or `get(None)`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._order: deque[GenerationOutput] = deque()
        self._expected: dict[str, int] = {}  # samples submitted, per id, until returned
        self._streamed: set[str] = set()
        self._unreturned = 0

    def expect(self, request_id: str, samples: int, streamed: bool) -> None:
        with self._cond:
            self._expected[request_id] = self._expected.get(request_id, 0) + samples
            if streamed:
                self._streamed.add(request_id)
            else:
                self._unreturned += samples

    def is_active(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._expected

    def expected_samples(self, request_id: str) -> int:
        with self._cond:
            return self._expected.get(request_id, 0)

    def put(self, output: GenerationOutput) -> None:
        with self._cond:
            if output.request_id in self._streamed:
                self._retire(output.request_id)
                return
            self._order.append(output)
            self._cond.notify_all()

    @overload
    def get(self, request_id: str | None, timeout: None) -> GenerationOutput: ...  # waits until there is one

    @overload
    def get(self, request_id: str | None, timeout: float | None) -> GenerationOutput | None: ...

    def get(self, request_id: str | None, timeout: float | None) -> GenerationOutput | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for output in self._order:
                    if request_id is None or output.request_id == request_id:
                        self._order.remove(output)
                        self._unreturned -= 1
                        self._retire(output.request_id)
                        return output
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def num_unreturned(self) -> int:
        with self._cond:
            return self._unreturned

    def _retire(self, request_id: str) -> None:
        left = self._expected.get(request_id, 0) - 1
        if left <= 0:
            self._expected.pop(request_id, None)
            self._streamed.discard(request_id)
        else:
            self._expected[request_id] = left
