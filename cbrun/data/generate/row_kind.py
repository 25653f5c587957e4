"""generate's row kind: one sampled request per row, for all of its `n` samples.

What a job does with generate's rows between parsing and results; score's is
data/score/row_kind.py. The job loop (data/job.py) is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cbrun.data.resume import ResumeState
from cbrun.data.rows import ParsedRow

if TYPE_CHECKING:
    from cbrun.engine.engine import Engine


@dataclass(frozen=True)
class GenerateRows:
    """Generated rows: one sampled request per row, for all of its `n` samples.

    On resume a row with only some samples written is run whole and the written
    samples are dropped: a sample's random stream is (seed, sample index), so it
    cannot be asked for alone, and a seeded rerun reproduces the missing ones exactly.
    """

    keep_prompt_ids: bool = False  # the output format writes the prompt's token ids

    def pending_samples(self, row: ParsedRow, resume: ResumeState | None) -> list[int]:
        samples = range(row.sampling.n)
        return resume.missing_samples(row.id, samples) if resume is not None else list(samples)

    def sort_key(self, row: ParsedRow) -> tuple[list[int], list[list[int]]]:
        return row.token_ids or [], []  # all set once tokenized

    def submit(self, engine: Engine, row: ParsedRow, samples: list[int], request_id: str) -> list[int]:
        token_ids = row.token_ids
        assert token_ids is not None  # tokenized, not yet submitted
        if not self.keep_prompt_ids:
            row.token_ids = None  # the engine holds its own copy; in-flight rows stay small
        engine.add_request(token_ids, row.sampling, request_id=request_id, lora=row.lora)
        return list(range(row.sampling.n))
