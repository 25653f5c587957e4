"""The bench's RSS sampler: cheap for in-process engines, and it still finds an engine's child processes.

Listing a process's descendants scans all of /proc (about 1 ms of CPU): every 50 ms beside a 2-core engine it
slowed a prefill by 13%, so the sampler lists them only when asked (vLLM's processes), and then once a second.
"""

from __future__ import annotations

import mmap
import subprocess
import sys
import time

import psutil
import pytest

import cbrun.bench.memory as memory_module
from cbrun.bench.memory import PeakRss, reset_peak


@pytest.mark.parametrize("mark_resets", [True, False], ids=["high-water-mark", "sampled"])
def test_own_rss_alone_never_lists_the_descendants(monkeypatch, mark_resets):
    def listed(*args, **kwargs):
        raise AssertionError("the descendants were listed for an in-process engine")

    monkeypatch.setattr(psutil.Process, "children", listed)
    if not mark_resets:  # where the kernel refuses the reset, the sampling thread runs: it must not list them either
        monkeypatch.setattr(memory_module, "reset_peak", lambda: False)
    with PeakRss(interval_s=0.001) as memory:
        time.sleep(0.05)
    assert memory.own > 10 << 20  # at least the interpreter
    assert memory.children == 0


def test_descendants_are_listed_once_per_renewal_and_summed(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 << 20); import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while psutil.Process(child.pid).memory_info().rss < 64 << 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        calls = []
        listing = psutil.Process.children

        def counted(self, *args, **kwargs):
            calls.append(1)
            return listing(self, *args, **kwargs)

        monkeypatch.setattr(psutil.Process, "children", counted)
        memory = PeakRss(interval_s=3600, children=True)
        for _ in range(3 * PeakRss.CHILD_LIST_EVERY):
            memory._sample()
        assert len(calls) == 3  # renewed every CHILD_LIST_EVERY samples, not at each
        assert memory.children >= 64 << 20  # the child's buffer, read at every sample
    finally:
        child.kill()
        child.wait()


def _touch(size: int) -> None:
    """Map `size` bytes outside malloc (whose thresholds other tests may raise), make them resident, unmap them."""
    region = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        region[offset] = 1
    region.close()


def test_the_own_peak_is_the_kernels_high_water_mark_since_the_engine_started():
    if not reset_peak():
        pytest.skip("this kernel refuses to reset the high-water mark (the sampler is used instead)")
    _touch(300 << 20)  # a peak before the engine starts: not the engine's
    with PeakRss(interval_s=3600) as memory:  # no sample between enter and exit: only the kernel's mark can see
        start = psutil.Process().memory_info().rss
        _touch(200 << 20)
    assert memory.own >= start + (190 << 20)
    assert memory.own < start + (290 << 20)
