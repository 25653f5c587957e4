"""The files in examples/ are valid inputs, and the RL rollout script runs."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from cli_helpers import REPO, cli_env
from fake_engine import FakeTokenizer

from cbrun.data.generate.openai_batch import OpenAIFormat
from cbrun.data.generate.preparer import GeneratePreparer
from cbrun.data.reader import open_input
from cbrun.data.rows import BadRow
from cbrun.engine.sampling_params import SamplingParams

EXAMPLES = REPO / "examples"


@pytest.mark.parametrize(
    "name", ["prompts.jsonl", "chat.jsonl", "prompts.parquet", "openai_batch.jsonl", "rl_prompts.jsonl"]
)
def test_every_example_row_is_valid(name):
    preparer = GeneratePreparer(
        FakeTokenizer(), SamplingParams(), max_context=4096, vocab_size=FakeTokenizer.vocab_size
    )
    converter = OpenAIFormat(FakeTokenizer(), "m") if name.startswith("openai") else None
    rows = list(open_input(str(EXAMPLES / name)))
    assert rows
    for raw in rows:
        spec = preparer.parse(raw, *converter.convert(raw)) if converter else preparer.parse(raw)
        assert not isinstance(spec, BadRow), spec.message
        [prepared] = preparer.tokenize([spec])
        assert not isinstance(prepared, BadRow), prepared.message


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_rl_rollout_script_gives_distinct_seeded_samples_with_logprobs(tiny_llama_dir, tmp_path):
    out = tmp_path / "rollouts.parquet"
    env = {**cli_env(), "MODEL": str(tiny_llama_dir), "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(
        [
            "bash",
            str(EXAMPLES / "rl_rollouts.sh"),
            "--max-tokens",
            "6",
            "--num-blocks",
            "256",
            "--page-size",
            "16",
            "-q",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 4 * 8
    for row_id in {r["id"] for r in rows}:
        samples = [r for r in rows if r["id"] == row_id]
        assert sorted(r["sample"] for r in samples) == list(range(8))
        assert len({tuple(r["completion_token_ids"]) for r in samples}) == 8
        assert all(len(r["logprobs"]) == r["num_completion_tokens"] for r in samples)
        assert all(r["answer"] and r["prompt_token_ids"] for r in samples)
    assert "mean reward" in proc.stdout
