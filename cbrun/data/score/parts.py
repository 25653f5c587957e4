"""A score job's preparer, output format and row kind, as its command line chose them.

The preparer needs the tokenizer and the model's limits, so `build` makes it
once the model is loaded. generate's counterpart is data/generate/parts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cbrun.data.job import JobParts, ModelLimits
from cbrun.data.score.format import ScoreFormat
from cbrun.data.score.preparer import ScorePreparer
from cbrun.data.score.row_kind import ScoreRows

if TYPE_CHECKING:
    from cbrun.engine.model_spec import Tokenizer


@dataclass(frozen=True)
class ScoreParts:
    """fmt: the rows' columns; kind: the scoring requests (prompt logprobs, top alternatives)."""

    fmt: ScoreFormat
    kind: ScoreRows
    prompt_column: str | None = None
    chat: bool = False
    keep_columns: tuple[str, ...] = ()

    def build(self, tokenizer: Tokenizer, limits: ModelLimits) -> JobParts:
        preparer = ScorePreparer(
            tokenizer,
            max_context=limits.max_context,
            vocab_size=limits.vocab_size,
            prompt_column=self.prompt_column,
            chat=self.chat,
            keep_columns=self.keep_columns,
        )
        return JobParts(preparer, self.fmt, self.kind)
