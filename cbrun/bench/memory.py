"""Peak resident memory of each engine while it runs, for the bench's table and JSON.

In-process engines (cbrun, transformers) are measured as this process's RSS,
sampled while they run (the model they share was loaded before, memory-mapped:
the pages an engine reads or packs count to it); vLLM runs in child processes,
measured as the sum of their RSS (shared pages counted in each: an upper
bound). Sampling every 50 ms misses spikes shorter than that; the process's
own high-water mark (ru_maxrss) is kept beside it for the in-process engines.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

import psutil


class PeakRss:
    """Samples this process's RSS and, separately, the summed RSS of its descendants, until closed."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.own = 0  # peak RSS of this process, bytes
        self.children = 0  # peak of the descendants' summed RSS, bytes
        self._stop = threading.Event()
        self._process = psutil.Process(os.getpid())
        self._thread = threading.Thread(target=self._sample_until_stopped, name="cbrun-bench-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        try:
            self.own = max(self.own, self._process.memory_info().rss)
        except psutil.Error:
            return
        total = 0
        for child in self._process.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:  # gone between listing and reading
                continue
        self.children = max(self.children, total)
