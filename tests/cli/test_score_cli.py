"""`cbrun score` end to end (issue 17): input shapes, generate's output as input, bad rows, resume after kill."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from cli_helpers import REPO, cli_env, read_jsonl, write_jsonl
from engine_helpers import reference_logprobs

from cbrun.cli.app import main
from cbrun.data.writers import journal_path
from cbrun.models import load_model

TOL = 1e-4
COLUMNS = [
    "id",
    "sample",
    "completion_token_ids",
    "logprobs",
    "sum_logprob",
    "num_completion_tokens",
    "is_greedy",
    "num_cached_tokens",
    "error",
]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """A plain copy of the tiny model (never handed to an engine) and its tokenizer."""
    return load_model(str(tiny_llama_dir), dtype="float32")


def score(model_dir, source: Path, out: Path, *extra) -> int:
    """`cbrun score` in fp32 (compared with fp32 references; --dtype auto is bf16 on CPUs with bf16 dot products)."""
    return main(
        [
            "score",
            str(source),
            str(out),
            "-m",
            str(model_dir),
            "-q",
            "--num-blocks",
            "256",
            "--dtype",
            "float32",
            *extra,
        ]
    )


def test_generate_output_is_valid_input_and_greedy_completions_score_as_greedy(tiny_llama_dir, tmp_path, reference):
    model, _ = reference
    prompts = [
        {"id": f"p{i}", "prompt": text}
        for i, text in enumerate(
            ["the quick brown fox", "paged attention keeps keys", "What is the capital of France?"]
        )
    ]
    prompts.append({"id": "chat", "messages": [{"role": "user", "content": "hello world"}]})
    source = write_jsonl(tmp_path / "in.jsonl", prompts)
    generated = tmp_path / "gen.jsonl"
    assert (
        main(
            [
                "generate",
                str(source),
                str(generated),
                "-m",
                str(tiny_llama_dir),
                "--dtype",
                "float32",
                "-q",
                "--temperature",
                "0",
                "--max-tokens",
                "12",
                "--n",
                "2",
                "--prompt-token-ids",
                "--logprobs",
            ]
        )
        == 0
    )
    scored = tmp_path / "scored.jsonl"
    assert score(tiny_llama_dir, generated, scored) == 0
    gen_rows = {(r["id"], r["sample"]): r for r in read_jsonl(generated)}
    rows = read_jsonl(scored)
    assert {(r["id"], r["sample"]) for r in rows} == set(gen_rows)  # id and sample kept
    for row in rows:
        expected = gen_rows[(row["id"], row["sample"])]
        assert list(row) == COLUMNS and row["error"] is None
        assert row["completion_token_ids"] == expected["completion_token_ids"]
        assert row["num_completion_tokens"] == len(expected["completion_token_ids"])
        assert row["is_greedy"] is True
        assert row["logprobs"] == pytest.approx(expected["logprobs"], abs=TOL)
        assert row["logprobs"] == pytest.approx(
            reference_logprobs(model, expected["prompt_token_ids"], expected["completion_token_ids"]), abs=TOL
        )
        assert row["sum_logprob"] == pytest.approx(sum(row["logprobs"]), abs=1e-6)
    # the two samples of each prompt share its cached prompt pages (page size 16)
    for prompt_id in ("p0", "p1", "p2", "chat"):
        cached = sorted(r["num_cached_tokens"] for r in rows if r["id"] == prompt_id)
        prompt_len = len(gen_rows[(prompt_id, 0)]["prompt_token_ids"])
        assert cached == [0, (prompt_len - 1) // 16 * 16]


def test_text_completions_are_tokenized_alone_after_the_prompt(tiny_llama_dir, tmp_path, reference):
    model, tokenizer = reference
    rows = [
        {"id": "t", "prompt": "the quick brown fox", "completions": [" jumps over", " is lazy"]},
        {"id": "c", "messages": [{"role": "user", "content": "hi"}], "completion": "hello world"},
    ]
    out = tmp_path / "out.jsonl"
    assert score(tiny_llama_dir, write_jsonl(tmp_path / "in.jsonl", rows), out) == 0
    got = {(r["id"], r["sample"]): r for r in read_jsonl(out)}
    text_prompt = tokenizer("the quick brown fox")["input_ids"]  # as generate encodes it: with BOS
    messages = [{"role": "user", "content": "hi"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_prompt = tokenizer(chat, add_special_tokens=False)["input_ids"]
    for key, prompt, text in [
        (("t", 0), text_prompt, " jumps over"),
        (("t", 1), text_prompt, " is lazy"),
        (("c", 0), chat_prompt, "hello world"),
    ]:
        completion = tokenizer(text, add_special_tokens=False)["input_ids"]  # no BOS in the completion
        assert got[key]["completion_token_ids"] == completion
        assert got[key]["logprobs"] == pytest.approx(reference_logprobs(model, prompt, completion), abs=TOL)


def test_bad_rows_become_error_rows_and_the_rest_is_scored(tiny_llama_dir, tmp_path, capsys):
    rows = [
        {"id": "ok", "input_ids": [1, 5, 6], "completion_token_ids": [7, 8]},
        {"id": "none", "prompt": "the fox"},
        {"id": "vocab", "input_ids": [1, 5], "completions_token_ids": [[7], [8, 4000]]},
        {"id": "long", "input_ids": [1, 5], "completion_token_ids": [3] * 2047},
        {"id": "dup", "input_ids": [1, 5], "completion_token_ids": [7], "sample": 1},
        {"id": "dup", "input_ids": [1, 5], "completion_token_ids": [8], "sample": 1},
        {"id": "generr", "completion_token_ids": [], "prompt_token_ids": None, "error": "row 9: prompt: empty"},
        {"id": "empty", "prompt": "the fox", "completion": ""},
        {"id": "badsample", "prompt": "the fox", "completion": "x", "sample": -1},
        "not json",
    ]
    out = tmp_path / "out.jsonl"
    assert score(tiny_llama_dir, write_jsonl(tmp_path / "in.jsonl", rows), out) == 1
    assert "Traceback" not in capsys.readouterr().err
    written = read_jsonl(out)
    good = [(r["id"], r["sample"]) for r in written if r["error"] is None]
    assert sorted(good) == [("dup", 1), ("ok", 0)]
    assert next(r for r in written if r["id"] == "ok")["num_completion_tokens"] == 2
    errors = {(r["id"], r["sample"]): r["error"] for r in written if r["error"]}
    assert "no completion" in errors[("none", 0)]
    assert "completions_token_ids[1]: token id 4000 at position 1 is outside the vocabulary" in errors[("vocab", 0)]
    assert "exceed the model's context" in errors[("long", 0)]
    assert "duplicate (id, sample) ('dup', 1)" in " ".join(errors.values())
    assert "the input row is an error row" in errors[("generr", 0)]
    assert "must be non-empty text" in errors[("empty", 0)]
    assert "sample: must be an integer >= 0" in errors[("badsample", 0)]
    assert "row 9: " in " ".join(errors.values())  # the line that is not JSON
    assert all(e.startswith("row ") for e in errors.values())
    assert len(written) == len(rows)  # one output row per input row here


def test_parquet_output_has_the_optional_columns(tiny_llama_dir, tmp_path, reference):
    model, _ = reference
    prompt, completion = [1, 40, 41, 42], [50, 51, 52]
    out = tmp_path / "out.parquet"
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": prompt, "completion_token_ids": completion}])
    assert score(tiny_llama_dir, source, out, "--top-logprobs", "2", "--prompt-logprobs") == 0
    table = pq.read_table(out)
    assert table.column_names == COLUMNS[:7] + ["top_logprobs", "prompt_logprobs"] + COLUMNS[7:]
    row = table.to_pylist()[0]
    assert row["prompt_logprobs"][0] is None and len(row["prompt_logprobs"]) == len(prompt)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()  # [L, V]
    expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(prompt[1:] + completion)[:, None])[:, 0]
    assert row["prompt_logprobs"][1:] == pytest.approx(expected[: len(prompt) - 1].tolist(), abs=TOL)
    assert row["logprobs"] == pytest.approx(expected[len(prompt) - 1 :].tolist(), abs=TOL)
    assert [len(top) for top in row["top_logprobs"]] == [2, 2, 2]


def test_usage_errors_are_one_line(tiny_llama_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "completion": "y"}])
    assert main(["score", str(source), str(tmp_path / "out.txt"), "-m", str(tiny_llama_dir)]) == 2
    assert main(["score", str(source), str(tmp_path / "o.jsonl"), "--top-logprobs", "-1"]) == 2
    assert main(["score", str(source), str(tmp_path / "o.jsonl"), "--keep-columns", "logprobs"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("cbrun: error:") == 3


# --- resume after a kill --------------------------------------------------------

NUM_ROWS = 80


def resume_rows() -> list[dict]:
    rng = random.Random(0)
    return [
        {
            "id": f"r{i}",
            "input_ids": [1] + [rng.randrange(3, 400) for _ in range(20 + i % 13)],
            "completions_token_ids": [[rng.randrange(3, 400) for _ in range(150 + 7 * j)] for j in range(3)],
        }
        for i in range(NUM_ROWS)
    ]


def resume_args(model_dir, *extra) -> list[str]:
    return ["-m", str(model_dir), "--num-blocks", "256", "--page-size", "16", "--max-batch-tokens", "32", *extra]


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_sigkill_then_resume_scores_every_completion_once(tiny_llama_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", resume_rows())
    whole = tmp_path / "whole.jsonl"
    assert main(["score", str(source), str(whole), *resume_args(tiny_llama_dir, "-q")]) == 0
    expected = {(r["id"], r["sample"]): r for r in read_jsonl(whole)}
    assert len(expected) == 3 * NUM_ROWS

    out = tmp_path / "out.parquet"
    on_disk = journal_path(out)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cbrun", "score", str(source), str(out), *resume_args(tiny_llama_dir, "--window", "2")],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while _lines(on_disk) < 3:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it could be killed: {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no rows were written in time")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    written = _lines(on_disk)
    assert 3 <= written < 3 * NUM_ROWS and not out.exists()
    assert main(["score", str(source), str(out), *resume_args(tiny_llama_dir)]) == 2  # refused without --resume
    capsys.readouterr()
    assert main(["score", str(source), str(out), *resume_args(tiny_llama_dir, "--resume", "-q")]) == 0
    rows = pq.read_table(out).to_pylist()
    keys = [(r["id"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) == len(expected)  # no duplicates, no gaps
    for row in rows:
        want = expected[(row["id"], row["sample"])]
        assert row["error"] is None and row["completion_token_ids"] == want["completion_token_ids"]
        assert row["logprobs"] == pytest.approx(want["logprobs"], abs=TOL)
    assert not on_disk.exists()


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0
