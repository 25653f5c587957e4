"""The heap keeps a step's big freed blocks (host_memory.py): a block freed and asked for again is not mapped
and faulted in afresh. Each case runs in its own interpreter, so the setting starts from glibc's default."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)

# Minor page faults of filling a 64 MB tensor the second time, after the first was freed.
_PROBE = """
import resource, sys, torch
from cbrun.engine.host_memory import keep_freed_blocks
if sys.argv[1] == "keep":
    assert keep_freed_blocks()
def fill_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(16 << 20, dtype=torch.float32)
    block.fill_(1.0)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
fill_faults()
print(fill_faults())
"""


def _second_fill_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


def test_freed_big_blocks_are_reused():
    pages = (64 << 20) // 4096
    assert _second_fill_faults("default") > pages // 2  # glibc's default: unmapped on free, faulted in again
    assert _second_fill_faults("keep") < pages // 16


def test_cpu_backend_keeps_freed_blocks(tiny_llama_dir, monkeypatch):
    """The CPU backend sets it once its weights are installed (a step's buffers are what it is for)."""
    from cbrun.engine import Engine, EngineConfig
    from cbrun.engine.backends.cpu import backend
    from cbrun.models import load_model

    calls: list[int] = []
    monkeypatch.setattr(backend, "keep_freed_blocks", lambda: calls.append(1) or True)
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    engine = Engine(model, tokenizer, EngineConfig())
    try:
        assert calls == [1]
    finally:
        engine.stop()
