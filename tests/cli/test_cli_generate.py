"""`cbrun generate` end to end on the tiny random Llama (issue 4, "Must show" 1, 2 and 4).

Most runs call `cbrun.cli.app.main` in this process (the model loads fast once
transformers is imported); stdin needs a real pipe, so that one is a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import REPO, by_key, cli_env, engine_args, read_jsonl, write_jsonl

from cbrun.cli.app import main

PROMPTS = [
    {"id": "fox", "prompt": "the quick brown fox"},
    {"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "ids", "input_ids": [1, 40, 41, 42, 43]},
]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory):
    """Greedy results of PROMPTS from a JSONL run: what every other input kind must reproduce."""
    folder = tmp_path_factory.mktemp("reference")
    out = folder / "out.jsonl"
    assert (
        main(["generate", str(write_jsonl(folder / "in.jsonl", PROMPTS)), str(out), *engine_args(tiny_llama_dir)]) == 0
    )
    rows = by_key(read_jsonl(out))
    assert set(rows) == {("fox", 0), ("chat", 0), ("ids", 0)}
    for row in rows.values():
        assert row["finish_reason"] in ("stop", "length") and row["error"] is None
        assert len(row["completion_token_ids"]) == row["num_completion_tokens"] > 0
    return rows


def same_completions(rows, reference) -> None:
    got = by_key(rows)
    assert set(got) == set(reference)
    for key, row in got.items():
        assert row["completion_token_ids"] == reference[key]["completion_token_ids"], key
        assert row["completion"] == reference[key]["completion"]
        assert row["num_prompt_tokens"] == reference[key]["num_prompt_tokens"]


def test_parquet_file_and_directory_inputs_give_the_same_rows(tiny_llama_dir, tmp_path, reference):
    table = pa.Table.from_pylist(
        [
            {"id": r["id"], "prompt": r.get("prompt"), "messages": r.get("messages"), "input_ids": r.get("input_ids")}
            for r in PROMPTS
        ]
    )
    pq.write_table(table, tmp_path / "in.parquet")
    assert (
        main(["generate", str(tmp_path / "in.parquet"), str(tmp_path / "a.parquet"), *engine_args(tiny_llama_dir)]) == 0
    )
    same_completions(pq.read_table(tmp_path / "a.parquet").to_pylist(), reference)
    (tmp_path / "dir").mkdir()
    pq.write_table(table.slice(0, 1), tmp_path / "dir" / "0.parquet")
    pq.write_table(table.slice(1), tmp_path / "dir" / "1.parquet")
    assert main(["generate", str(tmp_path / "dir"), str(tmp_path / "b.jsonl"), *engine_args(tiny_llama_dir)]) == 0
    same_completions(read_jsonl(tmp_path / "b.jsonl"), reference)


def test_saved_hf_dataset_input(tiny_llama_dir, tmp_path, reference):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(
        [
            {"id": r["id"], "prompt": r.get("prompt"), "messages": r.get("messages"), "input_ids": r.get("input_ids")}
            for r in PROMPTS
        ]
    ).save_to_disk(str(tmp_path / "ds"))
    assert (
        main(["generate", "--dataset", str(tmp_path / "ds"), str(tmp_path / "out.jsonl"), *engine_args(tiny_llama_dir)])
        == 0
    )
    same_completions(read_jsonl(tmp_path / "out.jsonl"), reference)


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_stdin_to_stdout_writes_only_json_lines_on_stdout(tiny_llama_dir, tmp_path, reference):
    data = "".join(json.dumps(r) + "\n" for r in PROMPTS).encode()
    proc = subprocess.run(
        [sys.executable, "-m", "cbrun", "generate", "-", "-", *engine_args(tiny_llama_dir)],
        input=data,
        capture_output=True,
        cwd=REPO,
        env=cli_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().splitlines()
    rows = [json.loads(line) for line in lines]  # every stdout line is a JSON row
    same_completions(rows, reference)
    assert b"Traceback" not in proc.stderr


def test_openai_batch_input_gives_openai_batch_output(tiny_llama_dir, tmp_path, reference):
    requests = [
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": PROMPTS[1]["messages"],
                "max_tokens": 8,
                "logprobs": True,
                "top_logprobs": 2,
            },
        },
        {
            "custom_id": "fox",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8},
        },
    ]
    out = tmp_path / "out.jsonl"
    assert (
        main(["generate", str(write_jsonl(tmp_path / "batch.jsonl", requests)), str(out), *engine_args(tiny_llama_dir)])
        == 0
    )
    lines = {line["custom_id"]: line for line in read_jsonl(out)}
    assert set(lines) == {"chat", "fox"}
    chat = lines["chat"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    choice = chat["body"]["choices"][0]
    assert choice["message"]["content"] == reference[("chat", 0)]["completion"]
    assert len(choice["logprobs"]["content"]) == 8 and len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert chat["body"]["usage"]["completion_tokens"] == 8
    fox = lines["fox"]["response"]["body"]
    assert fox["object"] == "text_completion" and fox["choices"][0]["text"] == reference[("fox", 0)]["completion"]
    # --format cbrun writes cbrun rows for the same input
    out2 = tmp_path / "out2.jsonl"
    assert (
        main(["generate", str(tmp_path / "batch.jsonl"), str(out2), "--format", "cbrun", *engine_args(tiny_llama_dir)])
        == 0
    )
    assert {r["id"] for r in read_jsonl(out2)} == {"chat", "fox"}


def test_optional_columns_and_keep_columns(tiny_llama_dir, tmp_path):
    rows = [{"id": "a", "prompt": "hello world", "label": 3, "meta": {"k": "v"}}]
    out = tmp_path / "out.parquet"
    assert (
        main(
            [
                "generate",
                str(write_jsonl(tmp_path / "in.jsonl", rows)),
                str(out),
                "--logprobs",
                "--top-logprobs",
                "3",
                "--prompt-token-ids",
                "--keep-columns",
                "label,meta",
                *engine_args(tiny_llama_dir, max_tokens=4),
            ]
        )
        == 0
    )
    [row] = pq.read_table(out).to_pylist()
    assert list(row) == [
        "id",
        "sample",
        "completion",
        "completion_token_ids",
        "logprobs",
        "top_logprobs",
        "finish_reason",
        "num_prompt_tokens",
        "num_completion_tokens",
        "num_cached_tokens",
        "error",
        "prompt_token_ids",
        "label",
        "meta",
    ]
    assert len(row["logprobs"]) == len(row["top_logprobs"]) == row["num_completion_tokens"] == 4
    assert all(lp <= 0 for lp in row["logprobs"]) and len(row["top_logprobs"][0]) == 3
    assert row["top_logprobs"][0][0]["token_id"] == row["completion_token_ids"][0]  # greedy: the top token
    assert len(row["prompt_token_ids"]) == row["num_prompt_tokens"]
    assert row["label"] == 3 and row["meta"] == {"k": "v"}


def test_every_kind_of_bad_row_becomes_an_error_row_and_exit_code_is_1(tiny_llama_dir, tmp_path, capsys):
    lines = [
        {"id": "good1", "prompt": "the quick brown fox"},
        "this is not json",
        "",
        {"id": "noprompt", "text": "no prompt field"},
        {"id": "empty", "prompt": ""},
        {"id": "long", "input_ids": [5] * 2100},
        {"id": "vocab", "input_ids": [1, 2, 100000]},
        {"id": "type", "prompt": "x", "temperature": "hot"},
        {"id": "range", "prompt": "x", "top_p": 2},
        {"id": "maxtok", "prompt": "x", "max_tokens": 0},
        {"id": "good1", "prompt": "duplicate id"},
        {"id": "badmsg", "messages": [{"content": "no role"}]},
        {"id": "good2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ]
    out = tmp_path / "out.jsonl"
    code = main(
        ["generate", str(write_jsonl(tmp_path / "in.jsonl", lines)), str(out), *engine_args(tiny_llama_dir)[:-1]]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err and "10 of 12 rows failed" in err
    assert "weights held" in err and "peak RSS" in err  # the summary says what the model cost in memory
    rows = read_jsonl(out)
    errors = {}
    for row in rows:
        if row["error"]:
            assert row["finish_reason"] == "error" and row["completion"] == "" and row["sample"] == 0
            errors.setdefault(row["id"], []).append(row["error"])
    good = {r["id"]: r for r in rows if r["error"] is None}
    assert set(good) == {"good1", "good2"} and good["good2"]["num_completion_tokens"] <= 4
    assert errors == {
        "1": ["row 1: not valid JSON: Expecting value: line 1 column 1 (char 0)"],
        "noprompt": [
            "row 2 (line 4): no prompt: expected a 'prompt', 'messages', 'input_ids' or 'prompt_token_ids' field"
        ],
        "empty": ["row 3 (line 5): prompt: empty prompt"],
        "long": [
            "row 4 (line 6): input_ids: prompt of 2100 tokens plus max_tokens 8 exceeds the model's "
            "context of 2048 tokens"
        ],
        "vocab": ["row 5 (line 7): input_ids: token id 100000 at position 2 is outside the vocabulary [0, 512)"],
        "type": ["row 6 (line 8): temperature: must be a number >= 0, got 'hot'"],
        "range": ["row 7 (line 9): top_p: must be in (0, 1], got 2"],
        "maxtok": ["row 8 (line 10): max_tokens: must be an integer >= 1, got 0"],
        "good1": ["row 9 (line 11): id: duplicate id 'good1' (first used by row 0)"],
        "badmsg": ["row 10 (line 12): messages: each chat message needs a string 'role' and a 'content'"],
    }


def test_n_samples_with_a_seed_are_distinct_and_reproducible_across_batch_budgets(tiny_llama_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    common = [
        "-m",
        str(tiny_llama_dir),
        "--max-tokens",
        "12",
        "--num-blocks",
        "128",
        "--page-size",
        "16",
        "-q",
        "--n",
        "4",
        "--seed",
        "1",
        "--temperature",
        "1",
    ]
    runs = []
    for name, extra in (("a", []), ("b", []), ("c", ["--max-batch-tokens", "8"])):
        out = tmp_path / f"{name}.jsonl"
        assert main(["generate", str(prompts), str(out), *common, *extra]) == 0
        runs.append({k: r["completion_token_ids"] for k, r in by_key(read_jsonl(out)).items()})
    first = runs[0]
    assert set(first) == {(i, s) for i in ("fox", "chat") for s in range(4)}
    for row_id in ("fox", "chat"):
        samples = [tuple(first[(row_id, s)]) for s in range(4)]
        assert len(set(samples)) == 4, samples
    assert runs[1] == first and runs[2] == first


@pytest.mark.parametrize(
    "args, message",
    [
        (["IN", "OUT.jsonl", "--n", "x"], "Invalid value for '--n'"),
        (["IN", "OUT.jsonl", "--bogus"], "No such option: --bogus"),
        (["IN", "OUT.jsonl", "--dtype", "int3"], "Invalid value for '--dtype'"),
        (["missing.jsonl", "OUT.jsonl"], "input not found: missing.jsonl"),
        (["IN", "OUT.csv"], "unknown output format"),
        (["IN", "EXISTING"], "exists (use --resume to finish that job, or --overwrite to replace it)"),
        (["IN", "-", "--resume"], "--resume needs an OUTPUT file"),
        (["IN", "OUT.jsonl", "--resume", "--overwrite"], "contradict"),
        (["IN", "OUT.jsonl", "--format", "openai"], "--format openai needs OpenAI Batch API input"),
        (["IN", "OUT.jsonl", "--keep-columns", "completion"], "--keep-columns: completion would overwrite"),
        (["IN", "OUT.jsonl", "--top-p", "3"], "invalid sampling option: top_p must be in (0, 1]"),
        (["IN", "OUT.jsonl", "--min-tokens", "300"], "invalid sampling option: min_tokens must be an integer >= 0"),
        (["IN", "OUT.jsonl", "--page-size", "1"], "invalid engine option: page_size must be at least 4"),
        (["IN", "WRONG", "--resume"], "cannot resume"),
        (["IN", "OUT.jsonl", "-m", "/no/such/model"], "/no/such/model"),
    ],
)
def test_usage_errors_print_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, message):
    write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    (tmp_path / "existing.jsonl").write_text("")
    (tmp_path / "wrong.jsonl").write_text('{"custom_id": "a", "response": {"status_code": 200}}\n')
    names = {
        "IN": str(tmp_path / "in.jsonl"),
        "OUT.jsonl": str(tmp_path / "out.jsonl"),
        "OUT.csv": str(tmp_path / "out.csv"),
        "EXISTING": str(tmp_path / "existing.jsonl"),
        "WRONG": str(tmp_path / "wrong.jsonl"),
    }
    args = [names.get(a, a) for a in args]
    if "-m" not in args:
        args += ["-m", "/no/such/model"]  # never loaded: every error here comes first
    monkeypatch.chdir(tmp_path)
    assert main(["generate", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cbrun: error: ") and message in lines[0], captured.err
    assert captured.out == ""
    assert not (tmp_path / "out.jsonl").exists()


def test_option_names_of_the_contract_exist():
    import typer

    from cbrun.cli.app import app

    command = typer.main.get_command(app).commands["generate"]
    names = {opt for param in command.params for opt in param.opts + param.secondary_opts}
    contract = [
        "--model",
        "-m",
        "--max-tokens",
        "--min-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--min-p",
        "--seed",
        "--n",
        "--stop",
        "--ignore-eos",
        "--logprobs",
        "--top-logprobs",
        "--dtype",
        "--device",
        "--page-size",
        "--num-blocks",
        "--max-batch-tokens",
        "--max-requests-per-batch",
        "--scheduler",
        "--safety-margin",
        "--no-prefix-cache",
        "--cpu-offload-gb",
        "--max-memory-percent",
        "--quiet",
        "-q",
        "--resume",
        "--overwrite",
        "--format",
        "--dataset",
        "--split",
        "--prompt-column",
        "--chat",
        "--keep-columns",
        "--prompt-token-ids",
        "--window",
    ]
    assert not [name for name in contract if name not in names]
