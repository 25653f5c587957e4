"""What the commands share: the usage-error type and exit codes, engine config and model loading, and the
--keep-columns check, each made before any model loads.

The options themselves, and the checks of INPUT and OUTPUT, are in `cbrun.cli.options`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

from cbrun.cli.choices import Device, Dtype

if TYPE_CHECKING:
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.model_spec import CausalLM, Tokenizer

EXIT_OK, EXIT_ROWS_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CliError(Exception):
    """A problem the user can fix: printed as one line, never a traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


def build_engine_config(
    *,
    page_size: int | None = None,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    max_requests_per_batch: int | None = None,
    scheduler: str | None = None,
    safety_margin: float | None = None,
    no_prefix_cache: bool = False,
    cpu_offload_gb: float | None = None,
    max_memory_percent: float | None = None,
    kernels: str | None = None,
    quantization: str | None = None,
    lora: Sequence[str] | None = None,
    max_lora_rank: int | None = None,
) -> EngineConfig:
    """EngineConfig from command-line values; None keeps EngineConfig's default.

    max_memory_percent accepts a fraction (0.5) or a percentage (50).
    Raises CliError naming the bad value.
    """
    from cbrun.engine import ConfigError, EngineConfig

    if max_memory_percent is not None and max_memory_percent > 1:
        max_memory_percent /= 100.0
    given: dict[str, Any] = {
        "page_size": page_size,
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests_per_batch,
        "scheduler": scheduler.value if isinstance(scheduler, Enum) else scheduler,
        "safety_margin": safety_margin,
        "allow_block_sharing": False if no_prefix_cache else None,
        "cpu_offload_space": cpu_offload_gb,
        "max_memory_percent": max_memory_percent,
        "kernels": kernels.value if isinstance(kernels, Enum) else kernels,
        "quantization": quantization.value if isinstance(quantization, Enum) else quantization,
        "lora_modules": lora_modules(lora) if lora else None,
        "max_lora_rank": max_lora_rank,
    }
    try:
        return EngineConfig(**{name: value for name, value in given.items() if value is not None})
    except ConfigError as exc:
        raise CliError(f"invalid engine option: {exc}") from None


def lora_modules(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """--lora NAME=PATH values as (name, path) pairs; CliError for one without a name, or a path that is no
    directory."""
    pairs = []
    for value in values:
        name, sep, path = (part.strip() for part in value.partition("="))
        if not sep or not name or not path:
            raise CliError(f"--lora {value!r}: expected NAME=PATH (a name for rows to use, a PEFT adapter directory)")
        path = os.path.expanduser(path)
        if not os.path.isdir(path):
            raise CliError(
                f"--lora {value!r}: {path!r} is not a directory (a PEFT adapter's, with adapter_config.json)"
            )
        pairs.append((name, path))
    return tuple(pairs)


def load_model(
    name: str, dtype: Dtype | str, device: Device | str, revision: str | None = None
) -> tuple[CausalLM, Tokenizer]:
    """`cbrun.models.load_model`, with every failure turned into a one-line CliError."""
    from cbrun.models import ModelLoadError, load_model as load

    try:
        return load(
            name, dtype=getattr(dtype, "value", dtype), device=getattr(device, "value", device), revision=revision
        )
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        raise CliError(f"cannot load model {name!r}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def quiet_libraries(quiet: bool) -> None:
    """Library warnings would drown our output; with --quiet, no progress bars or logs either."""
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        if quiet:
            transformers.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    if quiet:
        logging.getLogger().setLevel(logging.ERROR)
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # the variable above is read only when huggingface_hub is first imported


def keep_columns(text: str | None, output_columns: Iterable[str]) -> tuple[str, ...]:
    """--keep-columns a,b as names; refused where a name would overwrite one of the command's own columns."""
    names = tuple(c.strip() for c in (text or "").split(",") if c.strip())
    clash = [c for c in names if c in output_columns]
    if clash:
        raise CliError(f"--keep-columns: {', '.join(clash)} would overwrite output columns")
    return names
