"""What every output format shares about its rows: their resume key, and the error messages resume reads.

Error messages start with `row N: ` when the input row itself is bad and with
`row N (engine): ` when the engine failed a valid row; a hard stop's rows say
`engine stopped`. `--resume` (resume.py) relies on those words to recognise
rows already written, whatever the format (data/generate/format.py,
data/generate/openai_batch.py, data/score/format.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cbrun.data.rows import ParsedRow
from cbrun.engine.request import GenerationOutput

STOPPED_MARKER = "engine stopped"
_BAD_ROW = re.compile(r"^row (\d+)(?: \(line \d+\))?: ")


@dataclass(frozen=True)
class RowKey:
    """What resume needs to know about one output row.

    samples: the (id, sample) pairs it completes; None with bad_row for a bad
    input row (keyed by row number); all=True for formats that write every
    sample of a request in one row (OpenAI batch output).
    killed: written by a run that was stopped hard; the work must be redone.
    """

    id: str
    samples: tuple[int, ...] = ()
    bad_row: int | None = None
    all: bool = False
    failed: bool = False
    killed: bool = False


def engine_error(row: ParsedRow, out: GenerationOutput) -> str:
    """The error column of a valid row the engine failed: `row N (engine): why`."""
    return f"{row.where} (engine): {out.error or out.finish_reason}"


def is_killed(finish_reason: str | None, error: str | None) -> bool:
    """A result of a hard stop or a cancel: not an answer, redo it on resume."""
    return finish_reason == "cancelled" or (finish_reason == "error" and STOPPED_MARKER in (error or ""))


def bad_row_number(error: str | None) -> int | None:
    """The row number of a bad-input error message, else None."""
    match = _BAD_ROW.match(error or "")
    return int(match.group(1)) if match else None
