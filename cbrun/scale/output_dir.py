"""The driver's side of OUTPUT (see `cbrun.scale.part_store`): refuse, clear or read it back before a run.

`prepare_output` is everything a run does to OUTPUT before the first block
starts: refuse an existing OUTPUT without --resume or --overwrite, remove what
a killed run left half-done (temporary files, parts whose manifest was never
written, attempt markers), write the job file and this run's token, and read
the manifests of the parts already written: their rows, as ranges, are what
--resume skips. Memory is one entry per part, never one per row.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cbrun.scale.part_store import MANIFEST_SUFFIX, BlockCounters, PartStore, read_manifest_meta
from cbrun.scale.row_ranges import RowRanges

JOB_FILE = "job.json"
FORMAT_VERSION = 1


class OutputError(Exception):
    """OUTPUT cannot be used for this run (exists, other format, unreadable manifests); one line."""


@dataclass
class OutputState:
    """What OUTPUT holds when a run starts: the rows done (--resume) and the counters of their parts."""

    done: RowRanges = field(default_factory=RowRanges.empty)
    counters: BlockCounters = field(default_factory=BlockCounters)
    parts: int = 0
    removed: int = 0  # parts of a killed run without a manifest, removed


def check_output(store: PartStore, *, resume: bool, overwrite: bool) -> None:
    """What `prepare_output` would refuse, without touching anything (checked before Ray starts)."""
    root = store.root
    if resume and overwrite:
        raise OutputError("--resume and --overwrite contradict each other")
    if not root.parent.is_dir():
        raise OutputError(f"output directory does not exist: {root.parent}")
    exists = f"{root} exists (use --resume to finish that job, or --overwrite to replace it)"
    if root.exists() and not root.is_dir() and not overwrite:
        raise OutputError(f"{root} is one file, written without --ray: resume it without --ray" if resume else exists)
    if root.is_dir() and _holds_a_job(store) and not overwrite:
        if not resume:
            raise OutputError(exists)
        _check_job(store)


def prepare_output(store: PartStore, *, resume: bool, overwrite: bool, input_name: str) -> OutputState:
    """Make `store.root` ready for run `store.run` (see the module docstring); raises OutputError."""
    check_output(store, resume=resume, overwrite=overwrite)
    root = store.root
    if root.exists() and not root.is_dir():
        root.unlink()  # --overwrite of a one-file OUTPUT
    elif overwrite and _holds_a_job(store):
        _clear(store)
    store.manifests.mkdir(parents=True, exist_ok=True)
    job = store.meta / JOB_FILE
    if not job.exists():
        _write_text(job, json.dumps({"version": FORMAT_VERSION, "format": store.kind, "input": input_name}) + "\n")
    _write_text(store.meta / "run", store.run + "\n")
    _remove_leftovers(store)
    return scan_output(store)


def _holds_a_job(store: PartStore) -> bool:
    return store.meta.exists() or any(_parts(store.root, store.suffix))


def _check_job(store: PartStore) -> None:
    job = store.meta / JOB_FILE
    if not job.exists():
        raise OutputError(f"cannot resume {store.root}: it was not written by cbrun generate --ray (no {job.name})")
    try:
        found = json.loads(job.read_text()).get("format")
    except (OSError, ValueError) as exc:
        raise OutputError(f"cannot resume {store.root}: unreadable {job}: {exc}") from None
    if found != store.kind:
        raise OutputError(f"cannot resume {store.root}: it holds {found} parts, not {store.kind}")


def _clear(store: PartStore) -> None:
    for path in _parts(store.root, store.suffix):
        path.unlink()
    for path in store.root.glob(".part-*.tmp"):
        path.unlink()
    shutil.rmtree(store.meta, ignore_errors=True)


def _remove_leftovers(store: PartStore) -> None:
    """Temporary files and attempt markers of earlier runs (their workers are gone)."""
    for folder in (store.root, store.manifests):
        for path in folder.glob(".part-*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    attempts = store.meta / "attempts"
    if attempts.exists():
        for run in attempts.iterdir():
            if run.name != store.run:
                shutil.rmtree(run, ignore_errors=True)


def scan_output(store: PartStore) -> OutputState:
    """Read the manifests; a part without one (its worker died between the two renames) is removed.

    `done` holds each row once; `counters.rows` counts it once per manifest holding it, so the two differ
    exactly when a row was written twice."""
    state = OutputState()
    manifests = {p.name[: -len(MANIFEST_SUFFIX)] for p in store.manifests.glob(f"part-*{MANIFEST_SUFFIX}")}
    pairs: list[list[int]] = []
    for part in _parts(store.root, store.suffix):
        stem = part.name[: -len(store.suffix)]
        if stem not in manifests:
            part.unlink()
            state.removed += 1
            continue
        manifests.discard(stem)
        path = store.manifests / f"{stem}{MANIFEST_SUFFIX}"
        try:
            meta = read_manifest_meta(path)
        except (OSError, ValueError, KeyError) as exc:
            raise OutputError(f"cannot resume {store.root}: unreadable manifest {path.name}: {exc}") from None
        pairs.extend(meta["ranges"])
        state.counters.add(BlockCounters.from_dict(meta))
        state.parts += 1
    for stem in manifests:  # a manifest whose part is gone (deleted by hand): its rows are not done
        (store.manifests / f"{stem}{MANIFEST_SUFFIX}").unlink()
    state.done = RowRanges.of_pairs(pairs)
    return state


def _parts(root: Path, suffix: str) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(root / e.name for e in os.scandir(root) if e.name.startswith("part-") and e.name.endswith(suffix))


def part_files(store: PartStore) -> list[Path]:
    """The part files in OUTPUT, in name (row) order."""
    return _parts(store.root, store.suffix)


def manifest_paths(store: PartStore) -> list[Path]:
    """The manifests of the parts in OUTPUT, in name (row) order."""
    return sorted(store.manifests.glob(f"part-*{MANIFEST_SUFFIX}"))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
