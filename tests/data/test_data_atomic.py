"""replace_atomically: the temporary file is fsynced before the rename, the directory after it when asked,
and a failed write leaves the old file and no temporary file behind."""

from __future__ import annotations

import os

import pytest

from cbrun.data import atomic
from cbrun.data.atomic import replace_atomically


@pytest.fixture
def synced(monkeypatch):
    """The inodes os.fsync was called on, in order (the temporary file's is the target's after the rename)."""
    calls: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        calls.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", spy)
    return calls


def test_the_new_content_replaces_the_old_after_the_temporary_file_is_fsynced(tmp_path, synced):
    path = tmp_path / "out.txt"
    path.write_text("old")
    seen = []

    def write(tmp):
        seen.append(tmp)
        tmp.write_text("new")

    replace_atomically(path, write)
    assert path.read_text() == "new"
    assert seen == [tmp_path / "out.txt.tmp"] and not seen[0].exists()
    assert synced == [path.stat().st_ino]  # the file only: no directory fsync unless asked


def test_sync_dir_fsyncs_the_directory_after_the_rename(tmp_path, synced):
    path = tmp_path / "out.txt"
    replace_atomically(path, lambda tmp: tmp.write_text("x"), tmp=tmp_path / ".out.txt.1.tmp", sync_dir=True)
    assert path.read_text() == "x"
    assert synced == [path.stat().st_ino, tmp_path.stat().st_ino]


def test_a_failed_write_or_a_refusal_before_the_rename_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")

    def half_write(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_atomically(path, half_write)

    def refuse():
        raise RuntimeError("a newer run started")

    with pytest.raises(RuntimeError, match="newer run"):
        replace_atomically(path, lambda tmp: tmp.write_text("new"), before_replace=refuse)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
