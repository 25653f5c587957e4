"""--lora NAME=PATH and a row's `lora` field, for generate and score: each row runs its adapter, a bad one is an
error row, and the job goes on."""

from __future__ import annotations

import pytest
from cli_helpers import by_key, engine_args, read_jsonl, write_jsonl
from lora_helpers import random_pairs, save

from cbrun import LLM, LoRARequest, SamplingParams
from cbrun.cli.app import main
from cbrun.cli.common import CliError, build_engine_config
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.models import load_model

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable")


def test_the_lora_option_is_parsed_into_lora_modules_and_checked(tmp_path):
    config = build_engine_config(lora=[f"a={tmp_path}", f" b = {tmp_path}"], max_lora_rank=32)
    assert config.lora_modules == (("a", str(tmp_path)), ("b", str(tmp_path)))
    assert config.enable_lora and config.max_lora_rank == 32
    assert not build_engine_config().enable_lora
    with pytest.raises(CliError, match="expected NAME=PATH"):
        build_engine_config(lora=[str(tmp_path)])
    with pytest.raises(CliError, match="is not a directory"):
        build_engine_config(lora=[f"a={tmp_path / 'nowhere'}"])
    with pytest.raises(CliError, match="given twice"):
        build_engine_config(lora=[f"a={tmp_path}", f"a={tmp_path}"])


def test_generate_and_score_run_each_rows_adapter(tiny_llama_dir, tmp_path, capsys):
    model, _ = load_model(str(tiny_llama_dir))
    a_dir, b_dir = save(tmp_path / "a", random_pairs(model, 1)), save(tmp_path / "b", random_pairs(model, 2))
    rows = [
        {"id": "1", "input_ids": [1, 40, 41, 42, 43], "lora": "a"},
        {"id": "2", "input_ids": [1, 50, 51], "lora": "b"},
        {"id": "3", "input_ids": [1, 40, 41, 42, 43]},
        {"id": "4", "input_ids": [1, 60], "lora": "missing"},
        {"id": "5", "input_ids": [1, 60], "lora": 7},
    ]
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    loras = ["--lora", f"a={a_dir}", "--lora", f"b={b_dir}"]
    code = main(["generate", str(source), str(out), *engine_args(tiny_llama_dir, max_tokens=5), *loras, "--logprobs"])
    assert code == 1  # two rows failed; the others are written
    got = by_key(read_jsonl(out))
    assert "unknown LoRA adapter 'missing' (loaded: a, b)" in got[("4", 0)]["error"]
    assert "lora: must be the name of an adapter" in got[("5", 0)]["error"]
    with LLM(str(tiny_llama_dir), enable_lora=True) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=5)
        for key, lora in ((("1", 0), LoRARequest("a", 1, str(a_dir))), (("2", 0), LoRARequest("b", 2, str(b_dir)))):
            prompt = {"prompt_token_ids": rows[int(key[0]) - 1]["input_ids"]}
            assert (
                got[key]["completion_token_ids"]
                == llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
            )
    assert got[("1", 0)]["completion_token_ids"] != got[("3", 0)]["completion_token_ids"]

    scores = [
        {
            "id": "1",
            "prompt_token_ids": rows[0]["input_ids"],
            "completion_token_ids": got[("1", 0)]["completion_token_ids"],
            "lora": "a",
        }
    ]
    score_in, score_out = write_jsonl(tmp_path / "score.jsonl", scores), tmp_path / "scored.jsonl"
    assert (
        main(["score", str(score_in), str(score_out), "-m", str(tiny_llama_dir), "--num-blocks", "128", "-q", *loras])
        == 0
    )
    [scored] = read_jsonl(score_out)
    assert scored["logprobs"] == got[("1", 0)]["logprobs"]
    assert (
        main(
            [
                "generate",
                str(source),
                str(out),
                "--overwrite",
                *engine_args(tiny_llama_dir),
                "--lora",
                "a=" + str(tmp_path),
            ]
        )
        == 2
    )
    assert "cannot start the engine" in capsys.readouterr().err
