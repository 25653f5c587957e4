"""Peak resident memory of each engine while it runs, for the bench's table and JSON.

In-process engines (cbrun, transformers) are measured as this process's RSS
while they run (the model they share was loaded before, memory-mapped:
the pages an engine reads or packs count to it); vLLM runs in child processes,
measured as the sum of their RSS (shared pages counted in each: an upper
bound). This process's peak is the kernel's own high-water mark (VmHWM),
reset when an engine starts (writing 5 to /proc/self/clear_refs), so no spike
is missed and no thread runs beside the engine; where the reset is refused it
is sampled every 50 ms. The descendants are sampled every 50 ms.

A sampler shares the machine with the engine it measures, so it must cost next
to nothing: listing a process's descendants scans every process in /proc
(about 1 ms of CPU), which every 50 ms slowed a 2-core cbrun prefill by 13%
(its OpenMP threads wait for whichever one the sampler preempted). So the
descendants are followed only for an engine that runs in child processes, and
their list is renewed once a second (a new process is counted from then on;
vLLM starts its processes once, at start-up).
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

import psutil


def reset_peak() -> bool:
    """Reset this process's high-water mark to its current RSS (Linux 4.0+); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def peak_since_reset() -> int:
    """This process's high-water mark (VmHWM), bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


class PeakRss:
    """This process's peak RSS while open (the kernel's high-water mark, or samples where it cannot be reset)
    and, where asked, the peak of its descendants' summed RSS (samples)."""

    CHILD_LIST_EVERY = 20  # samples between listings of the descendants (1 s at the default interval)

    def __init__(self, interval_s: float = 0.05, children: bool = False) -> None:
        self.interval_s = interval_s
        self.own = 0  # peak RSS of this process, bytes
        self.children = 0  # peak of the descendants' summed RSS, bytes (0 unless `children`)
        self._track_children = children
        self._known: list[psutil.Process] = []  # the descendants as last listed
        self._samples = 0
        self._exact = False  # the own peak from the kernel's high-water mark, not from samples
        self._stop = threading.Event()
        self._process = psutil.Process(os.getpid())
        self._thread = threading.Thread(target=self._sample_until_stopped, name="cbrun-bench-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._exact = reset_peak()
        self._sample()
        if self._track_children or not self._exact:
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()
        if self._exact:
            self.own = max(self.own, peak_since_reset())

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        try:
            self.own = max(self.own, self._process.memory_info().rss)
        except psutil.Error:
            return
        if not self._track_children:
            return
        if self._samples % self.CHILD_LIST_EVERY == 0:
            try:
                self._known = self._process.children(recursive=True)
            except psutil.Error:
                self._known = []
        self._samples += 1
        total = 0
        for child in self._known:
            try:
                total += child.memory_info().rss
            except psutil.Error:  # gone since it was listed
                continue
        self.children = max(self.children, total)
