"""The job loop with a model-free engine: windows, bad rows, resume, stops, OpenAI grouping."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine

from cbrun.data.generate.format import CbrunFormat
from cbrun.data.generate.openai_batch import OpenAIFormat
from cbrun.data.generate.preparer import GeneratePreparer
from cbrun.data.generate.row_kind import GenerateRows
from cbrun.data.job import Job
from cbrun.data.output_rows import RowKey
from cbrun.data.reader import InputError, RawRow
from cbrun.data.resume import ResumeState
from cbrun.engine.sampling_params import SamplingParams


class ListWriter:
    def __init__(self):
        self.rows = []

    def write(self, row):
        self.rows.append(row)

    def maybe_flush(self):
        pass

    def flush(self):
        pass


def make_job(records, engine=None, *, window=8, resume=None, fmt=None, openai=None, n=1):
    engine = engine or FakeEngine()
    preparer = GeneratePreparer(
        engine.tokenizer,
        SamplingParams(max_tokens=4, n=n, seed=5),
        max_context=engine.max_context,
        vocab_size=engine.vocab_size,
    )
    rows = [RawRow(i, r) for i, r in enumerate(records)]
    writer = ListWriter()
    fmt = fmt or CbrunFormat()
    kind = GenerateRows(keep_prompt_ids=getattr(fmt, "prompt_token_ids", False))
    job = Job(engine, rows, preparer, fmt, writer, kind=kind, window=window, resume=resume, openai=openai)
    return job, engine, writer


def keys(rows):
    return sorted((r["id"], r["sample"]) for r in rows)


def test_every_row_and_sample_is_written_once_within_the_window():
    records = [{"prompt": f"prompt number {i}"} for i in range(50)]
    job, engine, writer = make_job(records, window=8, n=2)
    progress = job.run()
    assert keys(writer.rows) == sorted((str(i), s) for i in range(50) for s in range(2))
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in writer.rows)
    assert engine.max_in_flight <= 8 * 2  # rows in flight x samples
    assert (progress.rows_done, progress.rows_failed, progress.samples_written) == (50, 0, 100)
    assert progress.rows_in_flight == 0 and not progress.interrupted


def test_a_window_is_submitted_sorted_by_prompt_token_ids():
    records = [{"prompt": p} for p in ["b shared", "a", "b shared x", "c"]]
    job, engine, _ = make_job(records)
    job._submit([RawRow(i, r) for i, r in enumerate(records)])
    assert engine.submitted == ["1", "0", "2", "3"]


def test_bad_rows_and_engine_failures_become_error_rows_and_the_job_goes_on():
    records = [
        {"prompt": "ok"},
        {"prompt": ""},
        {"id": "x", "prompt": "fails in engine"},
        {"prompt": "ok too"},
        {"id": "x", "prompt": "duplicate"},
    ]
    engine = FakeEngine(fail={"2"})
    job, engine, writer = make_job(records, engine)
    progress = job.run()
    by_id = {}
    for r in writer.rows:
        by_id.setdefault(r["id"], []).append(r)
    assert by_id["0"][0]["error"] is None and by_id["3"][0]["error"] is None
    assert by_id["1"][0]["error"] == "row 1: prompt: empty prompt"
    errors = sorted(r["error"] for r in by_id["x"])
    assert errors == ["row 2 (engine): boom", "row 4: id: duplicate id 'x' (first used by row 2)"]
    assert progress.rows_done == 5 and progress.rows_failed == 3


def test_resume_skips_written_samples_and_rows_and_fills_the_gaps():
    records = [{"prompt": f"p{i}"} for i in range(6)] + [{"prompt": ""}]
    state = ResumeState()
    for key in (RowKey("0", (0,)), RowKey("0", (1,)), RowKey("1", (1,)), RowKey("6", bad_row=6, failed=True)):
        state.add(key)
    job, engine, writer = make_job(records, resume=state, n=2)
    progress = job.run()
    assert keys(writer.rows) == [("1", 0)] + [(str(i), s) for i in range(2, 6) for s in range(2)]
    assert "0" not in engine.submitted
    assert progress.rows_done == 7 and progress.rows_skipped == 2 and progress.rows_failed == 1


def test_resumed_partial_row_reproduces_the_missing_seeded_sample():
    records = [{"prompt": "p"}]
    job, _, writer = make_job(records, n=3)
    job.run()
    complete = {r["sample"]: r["completion"] for r in writer.rows}
    state = ResumeState()
    state.add(RowKey("0", (0, 2)))
    job, _, writer = make_job(records, resume=state, n=3)
    job.run()
    assert [(r["sample"], r["completion"]) for r in writer.rows] == [(1, complete[1])]


class StopAfter(FakeEngine):
    """Asks the job to stop after `after` results have been handed out."""

    def __init__(self, after, hard, **kwargs):
        super().__init__(**kwargs)
        self.after, self.hard, self.given, self.job = after, hard, 0, None

    def get_result(self, request_id=None, timeout=None):
        out = super().get_result(request_id, timeout)
        if out is not None:
            self.given += 1
            if self.given == self.after:
                self.job.stop(hard=self.hard)
                self.submitted_at_stop = len(self.submitted)
        return out


def test_first_stop_finishes_in_flight_rows_and_reads_no_more():
    records = [{"prompt": f"p{i}"} for i in range(40)]
    engine = StopAfter(3, hard=False)
    job, _, writer = make_job(records, engine, window=6)
    engine.job = job
    progress = job.run()
    assert progress.interrupted
    assert len(engine.submitted) == engine.submitted_at_stop < 40  # nothing read after the stop
    assert keys(writer.rows) == keys([{"id": i, "sample": 0} for i in engine.submitted])


def test_hard_stop_writes_finished_results_and_drops_killed_ones():
    records = [{"prompt": f"p{i}"} for i in range(40)]
    engine = StopAfter(3, hard=True)
    job, _, writer = make_job(records, engine, window=6)
    engine.job = job
    progress = job.run()
    assert progress.interrupted and len(writer.rows) == 3
    assert all(r["error"] is None for r in writer.rows)
    assert progress.rows_done == 3


def test_openai_rows_are_written_once_all_samples_are_in():
    records = [
        {
            "custom_id": f"c{i}",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"q{i}"}], "n": 3},
        }
        for i in range(5)
    ]
    records.append({"custom_id": "bad", "url": "/v1/nope", "body": {}})
    engine = FakeEngine()
    fmt = OpenAIFormat(engine.tokenizer, "m")
    job, _, writer = make_job(records, engine, fmt=fmt, openai=fmt)
    job.run()
    assert sorted(r["custom_id"] for r in writer.rows) == ["bad", "c0", "c1", "c2", "c3", "c4"]
    good = [r for r in writer.rows if r["custom_id"] != "bad"]
    assert all(len(r["response"]["body"]["choices"]) == 3 for r in good)
    bad = next(r for r in writer.rows if r["custom_id"] == "bad")
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["message"].startswith("row 5: url")


def test_an_input_that_breaks_mid_way_raises_input_error():
    def rows():
        yield RawRow(0, {"prompt": "a"})
        raise OSError("disk gone")

    engine = FakeEngine()
    preparer = GeneratePreparer(
        engine.tokenizer, SamplingParams(max_tokens=2), max_context=64, vocab_size=engine.vocab_size
    )
    job = Job(engine, rows(), preparer, CbrunFormat(), ListWriter(), kind=GenerateRows())
    with pytest.raises(InputError, match="disk gone"):
        job.run()
