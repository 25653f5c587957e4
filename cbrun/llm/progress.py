"""The "Processed prompts" bar of `LLM.generate`, as vLLM's `use_tqdm` asks for it.

`use_tqdm=True` draws a rich bar on stderr (only when stderr is a terminal,
so logs stay clean); a callable is used as vLLM uses it, a tqdm-like class
called with `total=` and `desc=`; False draws nothing.
"""

from __future__ import annotations

import sys
from typing import Any


class PromptProgress:
    """Counts finished prompts; closes its bar on exit."""

    def __init__(self, use_tqdm: Any, total: int) -> None:
        self._bar = None
        self._rich = None
        if callable(use_tqdm):
            self._bar = use_tqdm(total=total, desc="Processed prompts")
        elif use_tqdm and total and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(
                TextColumn("Processed prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False
            )
            self._task = self._rich.add_task("prompts", total=total)
            self._rich.start()

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)
        elif self._rich is not None:
            self._rich.advance(self._task)

    def __enter__(self) -> PromptProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._rich is not None:
            self._rich.stop()
