"""Prompts from a cbrun input file (`--dataset-path`), e.g. real chats.

Reuses `cbrun generate`'s readers and prompt builder (cbrun.data), so any
input it accepts works here (JSONL, JSON, Parquet, saved HF datasets) with the
same rules: `prompt` text is tokenized as the engine would, `messages` go
through the chat template with a generation prompt, `input_ids` are used as
is, and a row's own `max_tokens` overrides `--output-len`; a row's structured-output
constraint (`json_schema`, `regex`, `choice`, `grammar`, `json_object`) goes to every engine. Rows that cannot
run are skipped and reported, since a benchmark needs valid requests only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbrun.bench.workload import Workload

if TYPE_CHECKING:
    from cbrun.engine.sampling_params import StructuredSpec

TOKENIZE_WINDOW = 256


@dataclass
class DatasetPrompts:
    prompts: list[list[int]] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    structured: list[StructuredSpec | None] = field(default_factory=list)  # per prompt: the row's constraint or None
    skipped: list[str] = field(default_factory=list)  # each message names the row


def read_dataset(
    path: str | Path, tokenizer: Any, *, output_len: int, max_context: int, vocab_size: int, limit: int | None = None
) -> DatasetPrompts:
    """The first `limit` usable rows as token ids and output lengths."""
    from cbrun.data.generate.preparer import GeneratePreparer
    from cbrun.data.reader import InputError, open_input
    from cbrun.data.rows import BadRow
    from cbrun.engine import SamplingParams

    try:
        source = open_input(str(path))
    except InputError as e:
        raise ValueError(str(e)) from e
    preparer = GeneratePreparer(
        tokenizer, SamplingParams(max_tokens=output_len), max_context=max_context, vocab_size=vocab_size
    )
    result = DatasetPrompts()
    window: list = []

    def flush() -> None:
        for row in preparer.tokenize(window):
            if isinstance(row, BadRow):
                result.skipped.append(row.message)
            elif limit is None or len(result.prompts) < limit:
                result.prompts.append(list(row.token_ids))
                result.output_lens.append(row.sampling.max_tokens)
                result.structured.append(row.sampling.structured)
        window.clear()

    for raw in source:
        if limit is not None and len(result.prompts) >= limit:
            break
        spec = preparer.parse(raw)
        if isinstance(spec, BadRow):
            result.skipped.append(spec.message)
            continue
        window.append(spec)
        wanted = TOKENIZE_WINDOW if limit is None else min(TOKENIZE_WINDOW, limit - len(result.prompts))
        if len(window) >= wanted:
            flush()
    flush()
    return result


def dataset_workload(
    path: str | Path,
    tokenizer: Any,
    *,
    output_len: int,
    max_context: int,
    vocab_size: int,
    num_prompts: int | None = None,
    n: int = 1,
    ignore_eos: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[Workload, list[str]]:
    """The workload from a dataset file and the messages of skipped rows."""
    data = read_dataset(
        path, tokenizer, output_len=output_len, max_context=max_context, vocab_size=vocab_size, limit=num_prompts
    )
    if not data.prompts:
        detail = f" ({data.skipped[0]})" if data.skipped else ""
        raise ValueError(f"{path}: no usable prompt rows{detail}")
    structured = data.structured if any(s is not None for s in data.structured) else None
    workload = Workload(
        prompts=data.prompts,
        output_lens=data.output_lens,
        n=n,
        ignore_eos=ignore_eos,
        temperature=temperature,
        seed=seed,
        source=str(path),
        structured=structured,
    )
    return workload, data.skipped
