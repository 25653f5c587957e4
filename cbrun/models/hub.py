"""Hub ids: the local Hugging Face cache first, without the network, else a download with huggingface_hub.

The only module of cbrun.models that talks to the hub. HF_TOKEN, HF_ENDPOINT and
HF_HUB_OFFLINE are honoured by huggingface_hub itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from cbrun.models.errors import ModelLoadError

# Files of a hub repo that transformers reads besides the weights: configs, tokenizer, chat template.
_METADATA_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")


def is_repo_id(spec: str) -> bool:
    """Whether `spec` is shaped like a hub id (owner/name), by huggingface_hub's own rules."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def cached_snapshot(spec: str, revision: str | None) -> str | None:
    """The cached snapshot folder of the hub id at `revision` (default branch when None) when it
    holds a config.json and whole weights; no network access, so a cached model never waits on the hub."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(spec, "config.json", revision=revision)
    if not isinstance(found, str) or not _has_weights(Path(found).parent):
        return None
    return str(Path(found).parent)


def _has_weights(folder: Path) -> bool:
    """Whether every weight file transformers will read is there (an interrupted download leaves some out)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index_name).is_file():
            try:
                shards = set(json.loads((folder / index_name).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError):
                return False
            return all((folder / shard).is_file() for shard in shards)
    return (folder / "model.safetensors").is_file() or (folder / "pytorch_model.bin").is_file()


def hub_files_to_fetch(names: list[str]) -> list[str]:
    """The repo's files that loading needs: top-level metadata and one copy of the weights.

    Repos often hold the weights twice or more (safetensors and .bin, a
    `consolidated` file, `original/`, GGUF or ONNX exports): only transformers'
    own safetensors shards are taken, else its .bin shards.
    """
    top = [name for name in names if "/" not in name]
    weights = [n for n in top if n.startswith("model") and n.endswith(".safetensors")] or [
        n for n in top if n.startswith("pytorch_model") and n.endswith(".bin")
    ]
    return sorted({n for n in top if n.endswith(_METADATA_SUFFIXES)} | set(weights))


def download_snapshot(spec: str, revision: str | None, not_found: str) -> str:
    """Download the hub id's files into the Hugging Face cache (progress bars on stderr); returns
    the snapshot folder. `not_found` opens the message of a failure: what else the spec was tried as."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    at = f" at revision {revision!r}" if revision else ""
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(
            f"{not_found}{at}; HF_HUB_OFFLINE is set, so it was not downloaded "
            f"(fetch it first, e.g. `hf download {spec}`)."
        )
    try:
        info = HfApi().model_info(spec, revision=revision)
        files = hub_files_to_fetch([sibling.rfilename for sibling in info.siblings or []])
        if "config.json" not in files:
            raise ModelLoadError(
                f"Cannot load model {spec!r}: the hub repository{at} has no config.json, "
                "so it is not a transformers model."
            )
        return snapshot_download(spec, revision=revision, allow_patterns=files)
    except GatedRepoError:
        raise ModelLoadError(
            f"Cannot load model {spec!r}: it is a gated repository on the hub; accept its terms at "
            f"{constants.ENDPOINT}/{spec} and set HF_TOKEN to a token of that account (or run `hf auth login`)."
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"Cannot load model {spec!r}: the hub repository has no revision {revision!r}.") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"{not_found}, and the hub has no model repository {spec!r} (or it is private: "
            "set HF_TOKEN to a token that can read it)."
        ) from None
    except ModelLoadError:
        raise
    except Exception as error:  # no network, hub down, disk full: httpx, OSError, HfHubHTTPError
        detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ModelLoadError(
            f"{not_found}{at}, and downloading it from the hub failed ({type(error).__name__}: {detail})."
        ) from None
