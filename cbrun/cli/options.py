"""The options `cbrun generate`, `score` and `bench` share, each declared once, and how typer reads them.

An options bundle is a dataclass whose fields are command-line parameters: a
field's annotation holds its type and its `typer.Option` (flags, help text,
help panel), the field's default is the option's default. A command's options
class inherits the bundles it takes, and `command(options_class, run)` turns
it into a typer command whose parameters are those fields; `run` gets one
options object. Commands that take a bundle therefore spell, document, default
and check its options the same way, and a new option is one field.

Bundles are listed last-first in a command's bases (a dataclass puts the
fields of its last base first): typer shows parameters, and their help
panels, in field order, and INPUT must come before OUTPUT.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypeVar

import typer

from cbrun.cli.choices import Device, Dtype, Kernels, Quantization, Scheduler
from cbrun.cli.common import CliError, build_engine_config
from cbrun.models import DEFAULT_MODEL

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from cbrun.data.reader import InputSource
    from cbrun.engine.config import EngineConfig

MODEL_PANEL, ENGINE_PANEL, INPUT_PANEL, OUTPUT_PANEL = "Model", "Engine", "Input", "Output"


def panel_option(panel: str) -> Callable[..., Any]:
    """typer.Option shown in one help panel: `panel_option("Input")(help=...)`."""
    return functools.partial(typer.Option, rich_help_panel=panel)


model_option, engine_option = panel_option(MODEL_PANEL), panel_option(ENGINE_PANEL)
input_option, output_option = panel_option(INPUT_PANEL), panel_option(OUTPUT_PANEL)


@dataclass
class Paths:
    """INPUT and OUTPUT of generate and score (each command's description says what its rows hold)."""

    input: Annotated[
        Optional[str],
        typer.Argument(
            help="Rows (see above): .jsonl/.json file, .parquet file or directory, saved HF dataset directory, "
            "or - (stdin).",
            show_default=False,
        ),
    ] = None
    output: Annotated[
        Optional[str],
        typer.Argument(
            help="Results: .jsonl or .parquet (by extension), or - for JSON Lines on stdout.", show_default=False
        ),
    ] = None


@dataclass
class ModelOptions:
    """Which weights, in which dtype, on which device."""

    model: Annotated[
        str,
        model_option(
            "--model",
            "-m",
            help="HF model dir, hub id (downloaded unless cached or HF_HUB_OFFLINE=1), .gguf file or alias.",
        ),
    ] = DEFAULT_MODEL
    dtype: Annotated[
        Dtype,
        model_option(
            help="Weights and compute dtype (auto: bf16 on CPUs with bf16 dot products, AVX512-BF16 or AMX, whose "
            "kernel passes its self-check; else fp32; bf16 or fp16 on GPU). `cbrun info` shows the choice."
        ),
    ] = Dtype.auto
    device: Annotated[Device, model_option(help="Where to run.")] = Device.auto
    revision: Annotated[
        Optional[str], model_option(help="Branch, tag or commit of a hub --model.", show_default=False)
    ] = None


@dataclass
class InputOptions:
    """Where rows come from when INPUT does not say it, and how they are read."""

    dataset: Annotated[
        Optional[str],
        input_option(help="A Hugging Face dataset (saved directory or name in the local cache) instead of INPUT."),
    ] = None
    split: Annotated[Optional[str], input_option(help="Dataset split (default: train, or the only one).")] = None
    prompt_column: Annotated[
        Optional[str],
        input_option(
            help="Column holding the prompt (text, chat messages or token ids) instead of prompt/messages/input_ids "
            "(and, for score, prompt_token_ids)."
        ),
    ] = None
    chat: Annotated[bool, input_option("--chat", help="Apply the chat template to text prompts too.")] = False
    window: Annotated[int, input_option(help="Read-ahead window: input rows in flight, prefix-sorted.")] = 4096


@dataclass
class OutputOptions:
    """Extra output columns and what to do with an existing OUTPUT."""

    top_logprobs: Annotated[
        int, output_option(help="Add top_logprobs: the K most likely tokens at each completion position.")
    ] = 0
    keep_columns: Annotated[Optional[str], output_option(help="Input columns to copy to the output (a,b,c).")] = None
    resume: Annotated[
        bool, output_option("--resume", help="Finish an interrupted job: keep OUTPUT's rows, do the rest.")
    ] = False
    overwrite: Annotated[bool, output_option("--overwrite", help="Replace an existing OUTPUT.")] = False


@dataclass
class QuietOption:
    """--quiet, for the job commands and the bench alike."""

    quiet: Annotated[
        bool, output_option("--quiet", "-q", help="Nothing on stderr but errors (no dashboard or progress).")
    ] = False


@dataclass
class EngineOptions:
    """The engine's knobs; None keeps EngineConfig's default."""

    page_size: Annotated[Optional[int], engine_option(help="KV-cache page size in tokens.")] = None
    num_blocks: Annotated[Optional[int], engine_option(help="KV-cache pages (default: sized from free memory).")] = None
    max_batch_tokens: Annotated[Optional[int], engine_option(help="Query tokens per forward pass.")] = None
    max_requests_per_batch: Annotated[Optional[int], engine_option(help="Sequences per forward pass.")] = None
    scheduler: Annotated[Optional[Scheduler], engine_option(help="Step ordering (default fifo).")] = None
    safety_margin: Annotated[
        Optional[float], engine_option(help="Free-cache fraction below which no new prefill starts.")
    ] = None
    no_prefix_cache: Annotated[bool, engine_option("--no-prefix-cache", help="Disable prefix caching.")] = False
    cpu_offload_gb: Annotated[
        Optional[float], engine_option(help="CPU swap pool (GiB) for preempted requests; 0 recomputes them.")
    ] = None
    max_memory_percent: Annotated[
        Optional[float], engine_option(help="Share of free memory for the KV cache (0.5 or 50).")
    ] = None
    kernels: Annotated[
        Optional[Kernels],
        engine_option(
            help="CPU linear kernels: portable (default; the same bits on every CPU) or fastest (may take a method "
            "whose bits are this CPU's own, e.g. oneDNN on fixed blocks, when a trial shows it faster; still "
            "batch-invariant).",
            show_default=False,
        ),
    ] = None
    quantization: Annotated[
        Optional[Quantization],
        engine_option(
            help="int8: W8A8 on the CPU kernels (every linear but the output head: int8 weights per output channel, "
            "quantized at load or read from a compressed-tensors W8A8 checkpoint, int8 activations per token, exact "
            "int32 sums; the same bits alone or in a crowd and on every CPU). Default: the model's dtype.",
            show_default=False,
        ),
    ] = None

    lora: Annotated[
        Optional[list[str]],
        engine_option(
            "--lora",
            metavar="NAME=PATH",
            help="A LoRA adapter to load, NAME=PATH (a PEFT adapter directory); rows run it with a 'lora' field "
            "naming it. Repeat for several: one step runs any mix of them, each row as it runs alone.",
            show_default=False,
        ),
    ] = None
    max_lora_rank: Annotated[
        Optional[int], engine_option(help="The largest LoRA rank an adapter may have (default 16).")
    ] = None

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these options ask for; raises CliError naming a bad value."""
        return build_engine_config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)})


@dataclass
class JobOptions(EngineOptions, QuietOption, OutputOptions, InputOptions, ModelOptions, Paths):
    """What every job command (generate, score) takes: INPUT and OUTPUT, the model, how rows are read,
    the output's extra columns and resume, --quiet and the engine's knobs."""

    def check_paths(self) -> str:
        """The INPUT / --dataset / OUTPUT / --window checks generate and score share; returns OUTPUT.

        With --dataset the one positional argument is OUTPUT, so it moves over.
        """
        if self.dataset is not None and self.output is None:
            self.input, self.output = None, self.input
        elif self.dataset is not None and self.input is not None:
            raise CliError("give either INPUT or --dataset, not both")
        if self.output is None:
            raise CliError("missing OUTPUT (a .jsonl or .parquet path, or - for stdout)")
        if self.window < 1:
            raise CliError(f"--window must be at least 1, got {self.window}")
        return self.output

    def open_rows(self, columns: set[str]) -> InputSource:
        """INPUT or --dataset, reading only `columns` (and --prompt-column) where the format allows."""
        from cbrun.data.reader import InputError, open_input

        if self.prompt_column:
            columns = {*columns, self.prompt_column}
        try:
            return open_input(self.input, dataset=self.dataset, split=self.split, columns=columns)
        except InputError as exc:
            raise CliError(str(exc)) from None


OptionsT = TypeVar("OptionsT", bound="DataclassInstance")


def command(options: type[OptionsT], run: Callable[[OptionsT], int]) -> Callable[..., int]:
    """`run` as a typer command: its parameters are the fields of the dataclass `options` (typer reads each
    field's annotation and default), its help is `run`'s docstring, and it calls `run(options(**values))`."""
    hints = typing.get_type_hints(options, include_extras=True)
    parameters = [
        inspect.Parameter(
            field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=hints[field.name]
        )
        for field in dataclasses.fields(options)
    ]

    def invoke(**values: Any) -> int:
        return run(options(**values))

    invoke.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # what typer reads
    invoke.__name__ = invoke.__qualname__ = run.__name__
    invoke.__doc__ = run.__doc__
    return invoke
