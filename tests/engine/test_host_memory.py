"""The heap keeps a step's big freed blocks (host_memory.py): a block freed and asked for again is not mapped
and faulted in afresh, once the heap has settled. Each case runs in its own interpreter, so the setting starts
from glibc's default."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)

# Minor page faults of each of _ROUNDS fills of a 64 MB tensor, each freed before the next. torch asks for
# 64-byte-aligned memory, which glibc serves with a little slack, so a freed block fits the next request of
# its size only when nothing small was allocated right after it; otherwise the heap grows once more and the
# fill faults afresh (measured: up to 4 such rounds after the first, then none). The last rounds are the
# heap a running engine has.
_ROUNDS = 10
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
print(" ".join(str(fill_faults()) for _ in range(int(sys.argv[2]))))
"""


def _fill_faults(mode: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode, str(_ROUNDS)], capture_output=True, text=True, check=True
    )
    return [int(word) for word in done.stdout.split()]


def test_freed_big_blocks_are_reused():
    pages = (64 << 20) // 4096
    default, kept = _fill_faults("default"), _fill_faults("keep")
    assert all(faults > pages // 2 for faults in default)  # glibc's default: unmapped on free, faulted in again
    assert kept[0] > pages // 2  # the first fill maps fresh memory either way
    assert sum(kept[-2:]) < pages // 16, kept  # the settled heap reuses the freed block


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
