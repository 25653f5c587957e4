"""Ray Data: a callable class for `Dataset.map_batches` that owns one cbrun engine per actor.

    import ray
    from cbrun.scale.ray_data import CbrunGenerator

    ds = ray.data.read_parquet("prompts/")            # columns: id, prompt (or messages, input_ids)
    out = ds.map_batches(CbrunGenerator, batch_format="pyarrow", batch_size=64, concurrency=2, num_cpus=1,
                         fn_constructor_kwargs=dict(model="smollm2-135m", threads=1,
                                                    sampling=dict(max_tokens=64, temperature=0)))
    out.write_parquet("results/")                      # the columns of `cbrun generate`

Each batch runs through the same `Job` as `cbrun generate` (validation,
tokenization, prefix-sorted submission, the output format), so a batch's
result rows have exactly the CLI's columns, and a bad row becomes an error row
instead of failing the Ray task. Row order is not kept; ids are. Ray keeps no
row numbers, so each row of a user's dataset needs an `id` (or `custom_id`)
column: a row without one gets an error row, and the row numbers in error
messages count from the start of its batch. `cbrun generate --ray` passes each
input row as the columns of `RAW_COLUMNS` instead (row number, the record as
JSON or the raw JSON line, the reader's error, the line number), so its error
rows read exactly as without Ray.

A batch is the unit of retry: if an actor dies mid-batch, Ray restarts it and
runs the whole batch again, and the block the dead attempt was building is
never delivered, so downstream every row appears once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from cbrun.data.generate.format import CbrunFormat
from cbrun.data.generate.preparer import GeneratePreparer
from cbrun.data.generate.row_kind import GenerateRows
from cbrun.data.job import Job, JobProgress
from cbrun.data.reader import RawRow, _parse_json_line
from cbrun.data.rows import ID_FIELDS
from cbrun.scale.raw_columns import ERROR, LINE, RAW_COLUMNS, RECORD, ROW, TEXT, raw_schema

__all__ = ["ERROR", "LINE", "RAW_COLUMNS", "RECORD", "ROW", "TEXT", "CbrunGenerator", "raw_rows", "raw_schema"]
NO_ID = "id: missing: rows of a Ray dataset have no row numbers, so each needs an 'id' (or 'custom_id') column"


class CbrunGenerator:
    """One engine per Ray actor: a batch of prompt rows in, a pyarrow Table of cbrun result rows out.

    model: as `cbrun generate -m` (HF directory, cached hub id, .gguf, alias).
    sampling: SamplingParams fields (max_tokens, temperature, seed, n, ...); rows may override them.
    engine: EngineConfig fields (page_size, num_blocks, max_batch_tokens, ...).
    threads: torch / OpenMP threads of this actor's engine; set it to the CPUs the actor reserves,
        or every actor starts one thread per core and they fight over them.
    logprobs, top_logprobs, prompt_token_ids, keep_columns, prompt_column, chat, revision: as the CLI flags.
    structured: every result row gets the `structured` column (complete / incomplete, null for a row
        without a constraint). Ray blocks must share one schema, so it is decided for the whole job:
        pass True when rows carry their own constraint columns (json_schema, regex, choice, grammar,
        json_object); a job-wide constraint (`sampling["structured"]`) turns it on by itself.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        sampling: dict | None = None,
        engine: dict | None = None,
        dtype: str = "auto",
        device: str = "auto",
        threads: int | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        prompt_token_ids: bool = False,
        keep_columns: tuple[str, ...] = (),
        prompt_column: str | None = None,
        chat: bool = False,
        revision: str | None = None,
        structured: bool = False,
    ):
        import torch

        from cbrun.engine import SamplingParams

        if threads is not None:
            torch.set_num_threads(threads)
        _quiet_loading()
        self.sampling = SamplingParams(
            **{**(sampling or {}), **({"top_logprobs": top_logprobs} if top_logprobs else {})}
        )
        self.engine, self._tokenizer = self._start_engine(model, engine or {}, dtype, device, revision)
        self.fmt = CbrunFormat(
            logprobs=logprobs,
            top_logprobs=self.sampling.top_logprobs > 0,
            prompt_token_ids=prompt_token_ids,
            keep_columns=tuple(keep_columns),
            structured=structured or self.sampling.structured is not None,
        )
        self._prompt_column, self._chat = prompt_column, chat

    def _start_engine(self, model: str, engine: dict, dtype: str, device: str, revision: str | None) -> tuple:
        """(engine, tokenizer) of this actor: the model loaded once, its engine started."""
        from cbrun.engine import Engine, EngineConfig
        from cbrun.models import load_model

        loaded, tokenizer = load_model(model, dtype=dtype, device=device, revision=revision)
        return Engine(loaded, tokenizer, EngineConfig(**engine)), tokenizer

    def __call__(self, batch: Any) -> Any:  # a pyarrow.Table
        """Generate for every row of `batch` (pyarrow Table, pandas DataFrame or dict of columns)."""
        rows = self.generate_rows(raw_rows(batch), JobProgress())
        return result_table(rows, self.fmt)

    def generate_rows(self, rows: list[RawRow], progress: JobProgress) -> list[dict]:
        """The output rows of `rows` (one Job; `progress` counts as it runs, for live views)."""
        preparer = GeneratePreparer(
            self._tokenizer,
            self.sampling,
            max_context=self.engine.max_context,
            vocab_size=self.engine.vocab_size,
            prompt_column=self._prompt_column,
            chat=self._chat,
            keep_columns=self.fmt.keep_columns,
        )
        sink = _RowSink()
        # one window holds the whole batch: every prompt is submitted at once, prefix-sorted
        kind = GenerateRows(keep_prompt_ids=self.fmt.prompt_token_ids)
        Job(self.engine, rows, preparer, self.fmt, sink, kind=kind, window=max(len(rows), 1), progress=progress).run()
        return sink.rows

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()


def _quiet_loading() -> None:
    """No weight-loading progress bars from every actor in the driver's log."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def raw_rows(batch: Any) -> list[RawRow]:
    """The batch's rows as the reader's RawRows (see the module docstring for the two layouts)."""
    records = _records(batch)
    if records and ROW in records[0]:
        return [_from_raw_columns(r) for r in records]
    rows = []
    for position, record in enumerate(records):
        if not any(record.get(name) is not None for name in ID_FIELDS):
            rows.append(RawRow(position, None, NO_ID))
        else:
            rows.append(RawRow(position, record))
    return rows


def _from_raw_columns(record: dict) -> RawRow:
    index, line = int(record[ROW]), record.get(LINE)
    if record.get(TEXT) is not None:  # a JSON line: parsed here, as the local reader parses it
        return _parse_json_line(record[TEXT], index, line or index + 1)
    text = record.get(RECORD)
    return RawRow(index, None if text is None else json.loads(text), record.get(ERROR), line)


def raw_blocks(rows: Iterable[RawRow], block_rows: int) -> Iterator[Any]:
    """pyarrow Tables of `block_rows` RawRows each, in RAW_COLUMNS (records as JSON text)."""
    import pyarrow as pa

    chunk: list[RawRow] = []

    def table() -> Any:
        return pa.table(
            [
                [r.index for r in chunk],
                [None if r.record is None else json.dumps(r.record, ensure_ascii=False, default=str) for r in chunk],
                [r.error for r in chunk],
                [r.line for r in chunk],
                [None] * len(chunk),
            ],
            schema=raw_schema(),
        )

    for raw in rows:
        chunk.append(raw)
        if len(chunk) >= block_rows:
            yield table()
            chunk = []
    if chunk:
        yield table()


def _records(batch: Any) -> list[dict]:
    if hasattr(batch, "to_pylist"):  # pyarrow Table (batch_format="pyarrow", recommended)
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas DataFrame: NaN means missing
        import pyarrow as pa

        return pa.Table.from_pandas(batch, preserve_index=False).to_pylist()
    columns = {name: _to_list(values) for name, values in dict(batch).items()}  # numpy dict ("default")
    size = len(next(iter(columns.values()), []))
    return [{name: values[i] for name, values in columns.items()} for i in range(size)]


def _to_list(values: Any) -> list:
    """numpy columns to plain Python values (nested object arrays too: chat messages, token ids)."""
    import numpy as np

    def plain(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value.item() if isinstance(value, np.generic) else value

    return [plain(v) for v in values]


def result_table(rows: list[dict], fmt: CbrunFormat) -> Any:  # a pyarrow.Table
    """Result rows as a pyarrow Table in the cbrun schema; kept columns that do not share a type become JSON text."""
    import pyarrow as pa

    keep_types = {}
    for name in fmt.keep_columns:
        try:
            found = pa.array([r.get(name) for r in rows]).type
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            found = None
        if found is None or pa.types.is_null(found):
            keep_types[name] = pa.string()
            if found is None:
                for r in rows:
                    value = r.get(name)
                    r[name] = value if value is None or isinstance(value, str) else json.dumps(value)
        else:
            keep_types[name] = found
    return pa.Table.from_pylist(rows, schema=fmt.arrow_schema(keep_types))


class _RowSink:
    """The writer a batch's Job writes to: rows kept in memory, returned as the batch's block."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        self.rows.append(row)

    def maybe_flush(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:  # nothing to close: the rows are returned as the batch's block
        pass
