"""The columns of a `cbrun generate --ray` input block: what read tasks produce and the actors read back.

Kept apart from `cbrun.scale.ray_data` (which imports the engine, and so torch) so that Ray's read and
count tasks start in a fraction of a second: they import this, pyarrow and the readers, nothing else.
"""

from __future__ import annotations

from typing import Any

ROW, RECORD, ERROR, LINE = "__cbrun_row", "__cbrun_record", "__cbrun_error", "__cbrun_line"
TEXT = "__cbrun_text"  # a JSON line as read (bytes): parsed on the actor, with the local reader's error messages
RAW_COLUMNS = (ROW, RECORD, ERROR, LINE, TEXT)


def raw_schema() -> Any:  # a pyarrow.Schema
    """The columns of a `cbrun generate --ray` input block (RAW_COLUMNS)."""
    import pyarrow as pa

    return pa.schema(
        [(ROW, pa.int64()), (RECORD, pa.string()), (ERROR, pa.string()), (LINE, pa.int64()), (TEXT, pa.binary())]
    )
