"""A generate job's preparer, output format and row kind, as its command line chose them.

The command decides everything before the model loads; the preparer needs
the tokenizer and the model's limits, and OpenAI Batch output needs the
tokenizer too, so `build` makes them once the model is loaded. score's
counterpart is data/score/parts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cbrun.data.generate.format import CbrunFormat
from cbrun.data.generate.openai_batch import OpenAIFormat
from cbrun.data.generate.preparer import GeneratePreparer
from cbrun.data.generate.row_kind import GenerateRows
from cbrun.data.job import JobParts, ModelLimits
from cbrun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbrun.engine.model_spec import Tokenizer


@dataclass(frozen=True)
class GenerateParts:
    """sampling: the job's parameters (rows may override); cbrun_format: the rows' columns;
    openai_input: the input is OpenAI Batch request lines; openai_output: answer them in the Batch output
    format (needs openai_input), else write cbrun rows; model_name: the Batch output's `model` field."""

    sampling: SamplingParams
    cbrun_format: CbrunFormat
    openai_input: bool = False
    openai_output: bool = False
    model_name: str = ""
    prompt_column: str | None = None
    chat: bool = False
    keep_columns: tuple[str, ...] = ()

    def build(self, tokenizer: Tokenizer, limits: ModelLimits) -> JobParts:
        converter = OpenAIFormat(tokenizer, self.model_name) if self.openai_input else None
        preparer = GeneratePreparer(
            tokenizer,
            self.sampling,
            max_context=limits.max_context,
            vocab_size=limits.vocab_size,
            prompt_column=self.prompt_column,
            chat=self.chat,
            keep_columns=self.keep_columns,
        )
        if self.openai_output:
            assert converter is not None  # the command asks for OpenAI output only for OpenAI input
            return JobParts(preparer, converter, GenerateRows(), openai=converter)
        kind = GenerateRows(keep_prompt_ids=self.cbrun_format.prompt_token_ids)
        return JobParts(preparer, self.cbrun_format, kind, openai=converter)
