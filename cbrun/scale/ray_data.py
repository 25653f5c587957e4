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
JSON, the reader's error), so its error rows read exactly as without Ray.

A batch is the unit of retry: if an actor dies mid-batch, Ray restarts it and
runs the whole batch again, and the block the dead attempt was building is
never delivered, so downstream every row appears once.
"""

from __future__ import annotations

import json
from typing import Any

from cbrun.data.generate.format import CbrunFormat
from cbrun.data.generate.preparer import GeneratePreparer
from cbrun.data.job import Job, JobProgress
from cbrun.data.reader import RawRow
from cbrun.data.rows import ID_FIELDS

ROW, RECORD, ERROR, LINE = "__cbrun_row", "__cbrun_record", "__cbrun_error", "__cbrun_line"
RAW_COLUMNS = (ROW, RECORD, ERROR, LINE)
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

        from cbrun.engine import Engine, EngineConfig, SamplingParams
        from cbrun.models import load_model

        if threads is not None:
            torch.set_num_threads(threads)
        _quiet_loading()
        self._model, self._tokenizer = load_model(model, dtype=dtype, device=device, revision=revision)
        self.sampling = SamplingParams(
            **{**(sampling or {}), **({"top_logprobs": top_logprobs} if top_logprobs else {})}
        )
        self.engine = Engine(self._model, self._tokenizer, EngineConfig(**(engine or {})))
        self.fmt = CbrunFormat(
            logprobs=logprobs,
            top_logprobs=self.sampling.top_logprobs > 0,
            prompt_token_ids=prompt_token_ids,
            keep_columns=tuple(keep_columns),
            structured=structured or self.sampling.structured is not None,
        )
        self._preparer_options = dict(prompt_column=prompt_column, chat=chat, keep_columns=tuple(keep_columns))

    def __call__(self, batch: Any):
        """Generate for every row of `batch` (pyarrow Table, pandas DataFrame or dict of columns)."""
        rows = raw_rows(batch)
        preparer = GeneratePreparer(
            self._tokenizer,
            self.sampling,
            max_context=self.engine.max_context,
            vocab_size=self.engine.vocab_size,
            **self._preparer_options,
        )
        sink = _RowSink()
        # one window holds the whole batch: every prompt is submitted at once, prefix-sorted
        Job(self.engine, rows, preparer, self.fmt, sink, window=max(len(rows), 1), progress=JobProgress()).run()
        return result_table(sink.rows, self.fmt)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
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
    text = record.get(RECORD)
    return RawRow(int(record[ROW]), None if text is None else json.loads(text), record.get(ERROR), record.get(LINE))


def _records(batch: Any) -> list[dict]:
    if hasattr(batch, "to_pylist"):  # pyarrow Table (batch_format="pyarrow", recommended)
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas DataFrame: NaN means missing
        import pyarrow as pa

        return pa.Table.from_pandas(batch, preserve_index=False).to_pylist()
    columns = {name: _to_list(values) for name, values in dict(batch).items()}  # numpy dict ("default")
    size = len(next(iter(columns.values()), []))
    return [{name: values[i] for name, values in columns.items()} for i in range(size)]


def _to_list(values) -> list:
    """numpy columns to plain Python values (nested object arrays too: chat messages, token ids)."""
    import numpy as np

    def plain(value):
        if isinstance(value, np.ndarray):
            return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value.item() if isinstance(value, np.generic) else value

    return [plain(v) for v in values]


def result_table(rows: list[dict], fmt: CbrunFormat):
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
