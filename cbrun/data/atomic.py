"""Replacing a file whole: write a temporary file beside it, fsync it, rename it over the target.

A reader, or a run after a kill, sees the old file or the new one, never a partial one: the rename is
atomic on one file system, and the fsync before it makes sure the name never points at data still in
the page cache. The directory is fsynced too where the rename itself must survive a power loss.
Used by the Parquet writer (data/writers.py), resume's rewrite (data/resume.py) and the parts of
`generate --ray` (scale/part_store.py, scale/finalize.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


def replace_atomically(
    path: Path,
    write: Callable[[Path], object],
    *,
    tmp: Path | None = None,
    before_replace: Callable[[], object] | None = None,
    sync_dir: bool = False,
) -> None:
    """Give `path` new content: `write(tmp)` fills the temporary file, which is fsynced and renamed over `path`.

    tmp: the temporary file's path, beside `path` (default `path` + ".tmp"); callers whose readers skip
        dot-files name it with a leading dot.
    before_replace: called after the fsync, just before the rename; it may raise to drop the write.
    sync_dir: fsync `path`'s directory after the rename, so the rename itself is durable.
    The temporary file is removed when any step fails; `path` is then untouched.
    """
    tmp = path.with_name(path.name + ".tmp") if tmp is None else tmp
    try:
        write(tmp)
        fsync_file(tmp)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if sync_dir:
        fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    """Flush a written file's data to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename, a new file) to the disk; silently skipped where the OS cannot."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
