"""The peers by name: `peer_runner(name)` imports a peer's module only when it is asked for.

Kept apart from the package's shared types (`PeerContext` in `__init__`): the peers import those
types, so the table that imports the peers cannot live beside them without an import circle.
"""

from __future__ import annotations

from collections.abc import Callable

from cbrun.bench.peers import PeerContext
from cbrun.bench.result import PeerResult
from cbrun.bench.workload import Workload


def peer_runner(name: str) -> Callable[[PeerContext, Workload, Workload], PeerResult]:
    """The run function of peer `name` (imported lazily: peers pull in heavy libraries)."""
    if name == "cbrun":
        from cbrun.bench.peers.cbrun_peer import run
    elif name == "cbrun-free":
        from cbrun.bench.peers.cbrun_peer import run_free as run
    elif name == "transformers":
        from cbrun.bench.peers.transformers_peer import run
    elif name == "hf-static":
        from cbrun.bench.peers.static_peer import run
    elif name == "vllm":
        from cbrun.bench.peers.vllm_peer import run
    else:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(PEER_NAMES)}")
    return run


PEER_NAMES = ("cbrun", "cbrun-free", "transformers", "hf-static", "vllm")
