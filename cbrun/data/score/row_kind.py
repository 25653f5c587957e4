"""score's row kind: one scoring request per input row, one result (sample) per completion to write.

What a job does with score's rows between parsing and results; generate's is
data/generate/row_kind.py. The job loop (data/job.py) is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cbrun.data.resume import ResumeState
from cbrun.data.score.preparer import ParsedScoreRow

if TYPE_CHECKING:
    from cbrun.engine.engine import Engine


@dataclass(frozen=True)
class ScoreRows:
    """Scored rows, the `RowKind` of a score job: one scoring request per input row, one result
    (sample) per completion still to write; resume skips every (id, sample) already written."""

    prompt_logprobs: bool = False
    top_logprobs: int = 0

    def pending_samples(self, row: ParsedScoreRow, resume: ResumeState | None) -> list[int]:
        return resume.missing_samples(row.id, row.samples) if resume is not None else list(row.samples)

    def sort_key(self, row: ParsedScoreRow) -> tuple[list[int], list[list[int]]]:
        return row.token_ids or [], row.completion_ids or []  # shared prompts adjacent (tokenized: both set)

    def submit(self, engine: Engine, row: ParsedScoreRow, samples: list[int], request_id: str) -> list[int]:
        assert row.token_ids is not None and row.completion_ids is not None  # tokenized, not yet submitted
        by_sample = dict(zip(row.samples, row.completion_ids))
        engine.add_score_request(
            row.token_ids,
            [by_sample[s] for s in samples],
            request_id,
            samples=samples,
            prompt_logprobs=self.prompt_logprobs,
            top_logprobs=self.top_logprobs,
            lora=row.lora,
        )
        row.token_ids, row.completion_ids = None, None  # the engine holds its own copies
        return samples
