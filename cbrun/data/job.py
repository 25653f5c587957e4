"""The job loop of generate and score: input rows -> engine -> output rows, with bounded memory.

    reader thread (RowPrefetcher) --(bounded queue)--> parse, resume check, tokenize
        --(sorted by prompt token ids)--> engine.add_request
    engine.get_result --> format --> writer (completion order)

At most `window` input rows are in flight (submitted and not yet fully
written) and at most PREFETCH_ROWS more wait in the reader's queue, whatever
the input length. New rows are taken once half the window has drained, so the
engine always has work while each refill is large enough for prefix sorting.

Stopping: `stop()` stops taking input and lets in-flight rows finish;
`stop(hard=True)` stops the engine at once (its queued and running requests
fail with "engine stopped"); results finished before are written, the killed
ones are not, so `--resume` redoes exactly them.

The loop is the same for every kind of row; what differs between generated
and scored rows (which samples a row still needs, the submission order, the
engine request a row becomes) is the job's `RowKind`, what a row asks its
preparer's, and how results become output rows its `OutputFormat`; each
command keeps the three side by side:

    data/generate/  preparer.py  GeneratePreparer   format.py  CbrunFormat   row_kind.py  GenerateRows
                                                    openai_batch.py  OpenAIFormat (OpenAI Batch in and out)
    data/score/     preparer.py  ScorePreparer      format.py  ScoreFormat   row_kind.py  ScoreRows

`parts.py` in each says how a command's job is made from its command line.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from cbrun.data.output_rows import is_killed
from cbrun.data.prefetch import RowPrefetcher
from cbrun.data.prompts import PromptPreparer
from cbrun.data.reader import RawRow
from cbrun.data.resume import ResumeState
from cbrun.data.rows import BadRow, ParsedRow
from cbrun.engine.request import GenerationOutput

if TYPE_CHECKING:
    from cbrun.engine.engine import Engine
    from cbrun.engine.model_spec import Tokenizer


class OutputFormat(Protocol):
    """What a job needs of its output format (CbrunFormat, OpenAIFormat, ScoreFormat)."""

    per_row: bool  # True: all samples of a row in one output row, written when the row finishes

    def result_rows(self, parsed: ParsedRow, results: list[tuple[int, GenerationOutput]]) -> list[dict]: ...

    def bad_row(self, bad: BadRow) -> dict: ...


class RowConverter(Protocol):
    """Turns an input row of another API into a cbrun row first (OpenAIFormat.convert: OpenAI Batch input)."""

    def convert(self, raw: RawRow) -> tuple[dict, dict] | BadRow:
        """(the row as cbrun reads it, its format extras), or why it cannot be read."""
        ...


class RowWriter(Protocol):
    """Where a job's output rows go (JsonlWriter, ParquetOutput)."""

    def write(self, row: dict) -> None: ...

    def maybe_flush(self) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


RowT_contra = TypeVar("RowT_contra", bound=ParsedRow, contravariant=True)


class RowKind(Protocol[RowT_contra]):
    """What a job does with its kind of row (the parsed_rows its preparer makes), between parsing and results."""

    def pending_samples(self, parsed: RowT_contra, resume: ResumeState | None) -> list[int]:
        """The samples of this row still to write (every one without resume); none: the row is done."""
        ...

    def sort_key(self, parsed: RowT_contra) -> tuple[list[int], list[list[int]]]:
        """Submission order within a window: rows sharing a prefix adjacent, so they hit the prefix cache."""
        ...

    def submit(self, engine: Engine, parsed: RowT_contra, samples: list[int], request_id: str) -> list[int]:
        """Add the row's engine request for `samples`; returns the samples the engine will return results for
        (those not in `samples` are dropped unwritten)."""
        ...


class ModelLimits(Protocol):
    """What a preparer checks rows against (an Engine has both)."""

    max_context: int
    vocab_size: int


@dataclass
class JobParts:
    """What a command brings to its job, made once the tokenizer and the model's limits are known."""

    preparer: PromptPreparer
    fmt: OutputFormat
    kind: RowKind[Any]
    openai: RowConverter | None = None  # OpenAI Batch API input: its converter


class PartsPlan(Protocol):
    """A command's parts as its command line chose them (GenerateParts, ScoreParts): `build` makes them."""

    @property
    def chat(self) -> bool:
        """Prompts are rendered with the chat template: the tokenizer must have one."""
        ...

    def build(self, tokenizer: Tokenizer, limits: ModelLimits) -> JobParts: ...


DEFAULT_WINDOW = 4096
PREFETCH_ROWS = 1024  # rows parsed ahead of the window
POLL_SECONDS = 0.1


@dataclass
class JobProgress:
    """Counters of a running job, read by the dashboard (rows are input rows)."""

    rows_total: int | None = None
    rows_done: int = 0  # input rows fully written (including skipped and failed)
    rows_failed: int = 0  # rows with an error row in the output (including earlier runs)
    rows_skipped: int = 0  # rows found complete in OUTPUT by --resume
    rows_in_flight: int = 0
    samples_written: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    interrupted: bool = False

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.started


@dataclass
class _Row:
    """An input row being generated; `remaining` counts samples still running."""

    parsed: ParsedRow
    remaining: int
    results: list[tuple[int, GenerationOutput]] = field(default_factory=list)
    skip: set[int] = field(default_factory=set)  # samples already in OUTPUT (resume)
    failed: bool = False
    killed: bool = False


@dataclass
class _Request:
    row: _Row
    remaining: int


class Job:
    """Runs one job to completion (or until stopped).

    engine: an Engine (add_request or add_score_request, get_result, stop).
    rows: the input rows. preparer: validation and tokenization.
    fmt: the output format (CbrunFormat, OpenAIFormat, ScoreFormat); writer: where rows go.
    kind: the rows' kind (generated rows: `GenerateRows`, data/generate/row_kind.py; scored: `ScoreRows`,
    data/score/row_kind.py); given by the caller, which knows its rows (the job runs either).
    openai: set when the input is OpenAI Batch API requests (rows are converted first).
    resume: what an earlier run wrote (those rows are skipped).
    """

    def __init__(
        self,
        engine: Engine,
        rows: Iterable[RawRow],
        preparer: PromptPreparer,
        fmt: OutputFormat,
        writer: RowWriter,
        *,
        kind: RowKind[Any],  # takes the parsed_rows `preparer` makes
        openai: RowConverter | None = None,
        resume: ResumeState | None = None,
        window: int = DEFAULT_WINDOW,
        progress: JobProgress | None = None,
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.engine = engine
        self.rows = rows
        self.preparer = preparer
        self.fmt = fmt
        self.writer = writer
        self.openai = openai
        self.resume = resume
        self.window = window
        self.progress = progress or JobProgress()
        if resume is not None:
            self.progress.rows_failed = resume.failed_rows
        self.kind: RowKind[Any] = kind
        self._requests: dict[str, _Request] = {}
        self._stop_level = 0  # 1: stop reading input, 2: stop at once

    def stop(self, hard: bool = False) -> None:
        """Safe to call from a signal handler: only sets a flag the loop reads."""
        self._stop_level = max(self._stop_level, 2 if hard else 1)

    def run(self) -> JobProgress:
        reader = RowPrefetcher(self.rows, maxsize=min(self.window, PREFETCH_ROWS))
        try:
            while True:
                if self._stop_level >= 2:
                    self._stop_engine()
                    break
                if self._stop_level == 0 and not reader.exhausted:
                    room = self.window - self.progress.rows_in_flight
                    if room >= max(1, self.window // 2):
                        self._submit(reader.take(room, timeout=0 if self._requests else POLL_SECONDS))
                if not self._requests:
                    if reader.exhausted or self._stop_level:
                        break
                    self.writer.maybe_flush()
                    continue
                out = self.engine.get_result(timeout=POLL_SECONDS)
                if out is not None:
                    self._on_result(out)
                self.writer.maybe_flush()
        finally:
            reader.close()
            self.writer.flush()
            self.progress.finished = time.perf_counter()
        self.progress.interrupted = self._stop_level > 0
        if self.progress.rows_total is not None and not self.progress.interrupted:
            self.progress.rows_total = self.progress.rows_done
        return self.progress

    # --- input side -----------------------------------------------------------

    def _submit(self, raws: list[RawRow]) -> None:
        parsed_rows: list[ParsedRow] = []
        missing: dict[int, list[int]] = {}  # row index -> samples to generate
        for raw in raws:
            parsed = self._parse(raw)
            if isinstance(parsed, BadRow):
                self._write_bad(parsed)
                continue
            samples = self.kind.pending_samples(parsed, self.resume)
            if not samples:
                self._count_skipped()
                continue
            parsed_rows.append(parsed)
            missing[parsed.index] = samples
        ready: list[ParsedRow] = []
        for item in self.preparer.tokenize(parsed_rows):
            if isinstance(item, BadRow):
                self._write_bad(item)
            else:
                ready.append(item)
        ready.sort(key=self.kind.sort_key)
        for parsed in ready:
            self._add(parsed, missing[parsed.index])

    def _parse(self, raw: RawRow) -> ParsedRow | BadRow:
        if self.openai is None:
            return self.preparer.parse(raw)
        converted = self.openai.convert(raw)
        if isinstance(converted, BadRow):
            return converted
        record, meta = converted
        return self.preparer.parse(raw, record, meta)

    def _add(self, parsed: ParsedRow, samples: list[int]) -> None:
        """Submit a row for `samples`; results for other samples (see `RowKind.submit`) are dropped."""
        request_id = str(parsed.index)
        returned = self.kind.submit(self.engine, parsed, samples, request_id)
        row = _Row(parsed, remaining=len(returned), skip=set(returned) - set(samples))
        self.progress.rows_in_flight += 1
        self._requests[request_id] = _Request(row, len(returned))

    def _write_bad(self, bad: BadRow) -> None:
        if self.resume is not None and self.resume.has_bad_row(bad.index):
            self._count_skipped()
            return
        self.writer.write(self.fmt.bad_row(bad))
        self.progress.samples_written += 1
        self.progress.rows_done += 1
        self.progress.rows_failed += 1

    def _count_skipped(self) -> None:
        self.progress.rows_skipped += 1
        self.progress.rows_done += 1

    # --- output side ------------------------------------------------------------

    def _on_result(self, out: GenerationOutput) -> None:
        request = self._requests.get(out.request_id)
        if request is None:  # not ours (or already complete): nothing to write
            return
        request.remaining -= 1
        if request.remaining == 0:
            del self._requests[out.request_id]
        row = request.row
        row.remaining -= 1
        sample = out.sample_index
        if self._stop_level >= 2 and is_killed(out.finish_reason, out.error):
            row.killed = True
        elif sample not in row.skip:
            row.failed |= out.finish_reason == "error"
            self._count_tokens(row.parsed, out)
            if self.fmt.per_row:
                row.results.append((sample, out))
            else:
                self._write(self.fmt.result_rows(row.parsed, [(sample, out)]))
        if row.remaining == 0:
            self._finish_row(row)

    def _finish_row(self, row: _Row) -> None:
        self.progress.rows_in_flight -= 1
        if row.killed:
            return  # not written (or only partly, per sample): --resume redoes it
        if self.fmt.per_row:
            self._write(self.fmt.result_rows(row.parsed, row.results))
        self.progress.rows_done += 1
        self.progress.rows_failed += row.failed

    def _write(self, rows: list[dict]) -> None:
        for row in rows:
            self.writer.write(row)
        self.progress.samples_written += len(rows)

    def _count_tokens(self, parsed: ParsedRow, out: GenerationOutput) -> None:
        self.progress.prompt_tokens += parsed.num_prompt_tokens
        self.progress.completion_tokens += len(out.token_ids)
        self.progress.cached_tokens += out.num_cached_tokens

    def _stop_engine(self, drain_seconds: float = 5.0) -> None:
        """Hard stop: fail what is running, then write what had finished before."""
        self.engine.stop(hard=True, timeout=drain_seconds)
        deadline = time.monotonic() + drain_seconds
        while self._requests and time.monotonic() < deadline:
            out = self.engine.get_result(timeout=POLL_SECONDS)
            if out is None:
                break
            self._on_result(out)
