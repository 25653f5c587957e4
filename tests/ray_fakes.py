"""Ray actors for tests and scripts/ray_scale.py: `PartWriter` with the fake engine, and ones that die.

They run in Ray workers, which cannot import test modules: call `ship_by_value()`
once in the driver so cloudpickle sends this module (and the fake engine) by value.
The fake engine finishes requests at once, so a job measures cbrun's and Ray's own
costs (reading, parts, manifests, the driver), not a model's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fake_engine import FakeEngine, FakeTokenizer

from cbrun.scale.part_writer import PartWriter


def ship_by_value() -> None:
    """Make Ray send this module and fake_engine to the workers by value."""
    import sys

    import ray

    for name in ("ray_fakes", "fake_engine"):
        ray.cloudpickle.register_pickle_by_value(sys.modules[name])


class FakeEngineWriter(PartWriter):
    """PartWriter whose engine is the fake one (`model` is ignored; pass --seed for deterministic rows)."""

    def _start_engine(self, model: str, engine: dict, dtype: str, device: str, revision: str | None) -> tuple:
        return FakeEngine(record_submitted=False), FakeTokenizer()


class DiesOnBigPieces(FakeEngineWriter):
    """Dies (as Ray's memory monitor would kill it) on any piece of more than `max_rows` rows, and on any piece
    holding row `poison` whatever its size: the block must be split, and the poison row given up."""

    def __init__(self, *, max_rows: int, poison: int = -1, **kwargs: Any):
        super().__init__(**kwargs)
        self.max_rows, self.poison = max_rows, poison

    def generate_rows(self, rows: list, progress: Any) -> list[dict]:
        if len(rows) > self.max_rows or any(r.index == self.poison for r in rows):
            os._exit(1)
        return super().generate_rows(rows, progress)


class DiesOnce(PartWriter):
    """The real engine; the first actor to generate a block kills its own process halfway through it
    (once per marker file), before anything of the block is written: Ray must run the block again."""

    def __init__(self, *, crash_marker: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.crash_marker = crash_marker

    def generate_rows(self, rows: list, progress: Any) -> list[dict]:
        if len(rows) > 1 and not Path(self.crash_marker).exists():
            # half the block, counted apart: an actor that loses the race to the marker below generates the whole
            # block again with `progress`, which must then count each row once
            super().generate_rows(rows[: len(rows) // 2], type(progress)())
            try:
                os.close(os.open(self.crash_marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return super().generate_rows(rows, progress)
            os._exit(1)  # as a killed node would: no exception, no cleanup
        return super().generate_rows(rows, progress)
