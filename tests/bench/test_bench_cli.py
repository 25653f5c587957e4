"""`cbrun bench` end to end on a tiny random model (issue 5, "Must show" 1-3).

Runs the real `cbrun` entry point (`cbrun.cli.app.main`). Configurations are
tiny: a few prompts, short lengths, small caches for both continuous-batching
engines.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from dataclasses import dataclass

import pytest

from cbrun.bench import runner as bench_runner
from cbrun.bench.report import TABLE_COLUMNS, fmt
from cbrun.cli.app import main

SMALL = [
    "--num-prompts",
    "6",
    "--input-len",
    "12",
    "--output-len",
    "6",
    "--random-range-ratio",
    "0.5",
    "--num-blocks",
    "64",
    "--page-size",
    "16",
    "--quiet",
]
TRANSFORMERS_SMALL = ["--transformers-cb-config", json.dumps({"num_blocks": 32, "max_batch_tokens": 256})]
FIXED_CEILING = {
    "gflop_per_token": 0.001,
    "gemm_rows": 256,
    "reference_dtype": "bfloat16",
    "gemm_gflops": {"bfloat16": {"best": 100.0}, "float32": {"best": 50.0}},
}


@dataclass
class Run:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@pytest.fixture
def invoke(capsys):
    """Run `cbrun bench ARGS` in-process; returns its exit code, stdout and stderr."""

    def run(args: list[str]) -> Run:
        capsys.readouterr()
        code = main(["bench", *args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


@pytest.fixture
def no_gemm_probe(monkeypatch):
    """Skip the GEMM measurement (seconds on a slow CPU) where a test does not look at it."""
    monkeypatch.setattr(bench_runner, "measure_ceiling", lambda model, dtype, device, quantization=None: FIXED_CEILING)


def _row_cells(stdout: str, engine: str) -> list[str]:
    """The figures of an engine's table row (after its name and dtype)."""
    row = next(line for line in stdout.splitlines() if line.startswith(f"│ {engine} "))
    return [c.strip() for c in row.strip("│").split("│")][2:]


def _row_dtype(stdout: str, engine: str) -> str:
    row = next(line for line in stdout.splitlines() if line.startswith(f"│ {engine} "))
    return [c.strip() for c in row.strip("│").split("│")][1]


def test_three_engines_give_rows_with_equal_output_counts_and_json_matching_the_table(tiny_llama_dir, tmp_path, invoke):
    out_json = tmp_path / "bench.json"
    result = invoke(
        [
            "--model",
            str(tiny_llama_dir),
            "--engine",
            "cbrun,transformers,hf-static",
            "--static-batch-size",
            "4",
            "--output-json",
            str(out_json),
            *SMALL,
            *TRANSFORMERS_SMALL,
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    entries = {e["engine"]: e for e in report["results"]}
    assert list(entries) == ["cbrun", "transformers", "hf-static"]
    expected = report["config"]["max_output_tokens"]
    for name, entry in entries.items():
        assert entry["status"] == "ok", entry
        assert entry["num_output_tokens"] == expected, name
        assert entry["output_count_check"] == "ok", entry["output_count_check"]
        cells = _row_cells(result.stdout, name)
        for (_, key, digits), cell in zip(TABLE_COLUMNS, cells):
            assert cell == fmt(entry[key], digits), (name, key)
        throughput = (
            f"Throughput: {fmt(entry['requests_per_s'])} requests/s, {fmt(entry['total_tokens_per_s'])} "
            f"total tokens/s, {fmt(entry['output_tokens_per_s'])} output tokens/s ({name})"
        )
        assert throughput in result.stdout
    assert entries["cbrun"]["ratio_to_cbrun"] == 1.0
    assert entries["cbrun"]["ttft_p50_s"] is not None and entries["transformers"]["ttft_p99_s"] is not None
    assert set(report["machine"]) >= {"cpu_model", "cpu_cores", "torch", "transformers", "device"}
    assert report["compute_ceiling"]["gemm_gflops"]["bfloat16"]["best"] > 0
    assert entries["cbrun"]["compute_ceiling_fraction"] > 0
    assert "Compute ceiling fraction" in result.stdout
    assert set(report["cbrun_stats"]) >= {
        "steps",
        "mean_decode_batch",
        "peak_kv_occupancy",
        "prefix_hit_rate",
        "offloads",
        "soft_resets",
    }
    assert report["cbrun_stats"]["steps"] > 0


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prefix_workload_hits_the_prefix_cache_unless_disabled(
    tiny_llama_dir, tmp_path, invoke, no_gemm_probe, prefix_cache
):
    out_json = tmp_path / "bench.json"
    args = [
        "--model",
        str(tiny_llama_dir),
        "--engine",
        "cbrun",
        "--prefix-len",
        "64",
        "--num-prompts",
        "8",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--num-blocks",
        "128",
        "--page-size",
        "16",
        "--output-json",
        str(out_json),
        "--quiet",
    ]
    result = invoke(args + ([] if prefix_cache else ["--no-prefix-cache"]))
    assert result.exit_code == 0, result.output
    rate = json.loads(out_json.read_text())["cbrun_stats"]["prefix_hit_rate"]
    if prefix_cache:
        assert rate > 0
    else:
        assert rate == 0
    assert re.search(r"prefix hit rate \d+\.\d%", result.stdout)


def test_unavailable_peer_is_reported_and_the_others_still_run(tiny_llama_dir, tmp_path, invoke, no_gemm_probe):
    out_json = tmp_path / "bench.json"
    result = invoke(
        [
            "--model",
            str(tiny_llama_dir),
            "--engine",
            "hf-static,vllm",
            "--vllm-python",
            str(tmp_path / "no-such-python"),
            "--output-json",
            str(out_json),
            *SMALL,
        ]
    )
    assert result.exit_code == 0, result.output
    entries = {e["engine"]: e for e in json.loads(out_json.read_text())["results"]}
    assert entries["hf-static"]["status"] == "ok"
    assert entries["vllm"]["status"] == "unavailable"
    assert "not an executable file" in entries["vllm"]["reason"]
    assert "vllm: unavailable" in result.stdout
    assert "(vllm)" not in result.stdout  # no throughput line is made up for it


def test_vllm_interpreter_without_vllm_is_unavailable(tiny_llama_dir, tmp_path, invoke, monkeypatch, no_gemm_probe):
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))  # no vllm reachable from this interpreter
    out_json = tmp_path / "bench.json"
    result = invoke(
        [
            "--model",
            str(tiny_llama_dir),
            "--engine",
            "vllm",
            "--vllm-python",
            sys.executable,
            "--output-json",
            str(out_json),
            *SMALL,
        ]
    )
    assert result.exit_code == 0, result.output
    entry = json.loads(out_json.read_text())["results"][0]
    assert entry["status"] == "unavailable" and "cannot import vllm" in entry["reason"]


FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vLLM's offline API: every request generates max_tokens tokens (or stops at 3)."""
    __version__ = "0.0-fake"

    class SamplingParams:
        def __init__(self, n=1, max_tokens=16, ignore_eos=False, temperature=1.0, top_p=1.0, seed=None):
            self.n, self.max_tokens, self.ignore_eos = n, max_tokens, ignore_eos

    class _Completion:
        def __init__(self, token_ids):
            self.token_ids = token_ids

    class _Metrics:
        first_token_latency = 0.01

    class _Output:
        def __init__(self, prompt, params):
            self.prompt_token_ids = prompt["prompt_token_ids"]
            length = params.max_tokens if params.ignore_eos else min(3, params.max_tokens)
            self.outputs = [_Completion([7] * length) for _ in range(params.n)]
            self.metrics = _Metrics()

    class LLM:
        def __init__(self, model, tokenizer, dtype, seed, max_model_len, disable_log_stats, kv_cache_memory_bytes):
            import os
            assert os.path.isfile(os.path.join(model, "config.json"))
            assert 512 << 20 <= kv_cache_memory_bytes <= 4 << 30
            self.max_model_len = max_model_len

        def generate(self, prompts, params, use_tqdm=False):
            return [_Output(p, sp) for p, sp in zip(prompts, params)]
''')


def test_vllm_peer_protocol_with_a_stand_in_vllm(tiny_llama_dir, tmp_path, invoke, monkeypatch, no_gemm_probe):
    fake = tmp_path / "fake" / "vllm"
    (fake / "inputs").mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs" / "__init__.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path / "cache"))
    out_json = tmp_path / "bench.json"
    result = invoke(
        [
            "--model",
            str(tiny_llama_dir),
            "--engine",
            "hf-static,vllm",
            "--vllm-python",
            sys.executable,
            "--output-json",
            str(out_json),
            *SMALL,
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    entries = {e["engine"]: e for e in report["results"]}
    vllm = entries["vllm"]
    assert vllm["status"] == "ok", vllm
    assert (
        vllm["num_output_tokens"] == entries["hf-static"]["num_output_tokens"] == report["config"]["max_output_tokens"]
    )
    assert vllm["ttft_p50_s"] == pytest.approx(0.01)
    assert vllm["details"]["vllm_version"] == "0.0-fake"
    assert vllm["details"]["model_dir"] == str(tiny_llama_dir)  # a local HF dir is passed as is


def test_mismatched_output_counts_are_reported(tiny_llama_dir, tmp_path, invoke, monkeypatch, no_gemm_probe):
    fake = tmp_path / "fake" / "vllm"
    (fake / "inputs").mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM.replace("if params.ignore_eos else", "if False else"))
    (fake / "inputs" / "__init__.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    result = invoke(["--model", str(tiny_llama_dir), "--engine", "vllm", "--vllm-python", sys.executable, *SMALL])
    assert result.exit_code == 0, result.output
    assert "OUTPUT TOKEN COUNT MISMATCH: vllm:" in result.stdout
    assert "MISMATCH" in _row_cells(result.stdout, "vllm")[-1]


def test_crashing_vllm_is_reported_failed_with_its_root_cause(
    tiny_llama_dir, tmp_path, invoke, monkeypatch, no_gemm_probe
):
    fake = tmp_path / "fake" / "vllm"
    (fake / "inputs").mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "__version__ = '0'\nSamplingParams = None\n"
        "class LLM:\n    def __init__(self, **kwargs):\n"
        "        import sys\n        print('INFO starting', file=sys.stderr)\n"
        "        raise ValueError('Available memory on node 0 is too small')\n"
    )
    (fake / "inputs" / "__init__.py").write_text("TokensPrompt = dict\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path / "cache"))
    out_json = tmp_path / "bench.json"
    result = invoke(
        [
            "--model",
            str(tiny_llama_dir),
            "--engine",
            "hf-static,vllm",
            "--vllm-python",
            sys.executable,
            "--output-json",
            str(out_json),
            *SMALL,
        ]
    )
    assert result.exit_code == 1
    entries = {e["engine"]: e for e in json.loads(out_json.read_text())["results"]}
    assert entries["hf-static"]["status"] == "ok"
    assert entries["vllm"]["status"] == "failed"
    assert "ValueError: Available memory on node 0 is too small" in entries["vllm"]["reason"]
    assert (tmp_path / "cache" / "vllm-last-failure.log").is_file()


def test_dataset_workload_runs_without_ignore_eos_by_default(
    tiny_llama_dir, tmp_path, invoke, no_gemm_probe, monkeypatch
):
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep this process's threads for other tests
    data = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)] + [{"prompt": "hello"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out_json = tmp_path / "bench.json"
    result = invoke(
        [
            "--model",
            str(tiny_llama_dir),
            "--engine",
            "cbrun,hf-static",
            "--dataset-path",
            str(data),
            "--output-len",
            "5",
            "--temperature",
            "0",
            "--num-blocks",
            "64",
            "--page-size",
            "16",
            "--threads",
            "1",
            "--output-json",
            str(out_json),
            "--quiet",
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    assert report["config"]["num_prompts"] == 4 and report["config"]["ignore_eos"] is False
    assert report["config"]["threads"] == 1
    assert all(e["status"] == "ok" and 0 < e["num_output_tokens"] <= 20 for e in report["results"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine", "cbrun,nope"], "unknown engine nope"),
        (["--transformers-cb-config", "{bad"], "not valid JSON"),
        (["--transformers-cb-config", '{"no_such_knob": 1}'], "no_such_knob"),
        (["--input-len", "4000", "--output-len", "4000"], "more than the model's context of 2048"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    ],
)
def test_usage_errors_are_one_line_with_exit_code_2(tiny_llama_dir, invoke, args, message):
    result = invoke(["--model", str(tiny_llama_dir), *args])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("cbrun: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


# -- each engine's dtype, --plot, random models of real shapes (issue 24) ----------------------------------


def test_the_table_names_each_engines_dtype_and_cbruns_linear_kernels(tiny_llama_dir, tmp_path, invoke, no_gemm_probe):
    out_json = tmp_path / "bench.json"
    result = invoke(
        [
            "--model",
            str(tiny_llama_dir),
            "--engine",
            "cbrun",
            "--dtype",
            "bfloat16",
            "--output-json",
            str(out_json),
            *SMALL,
        ]
    )
    assert result.exit_code == 0, result.output
    entry = json.loads(out_json.read_text())["results"][0]
    assert entry["dtype"] == "bfloat16" and _row_dtype(result.stdout, "cbrun") == "bfloat16"
    assert "linear kernels: bfloat16 dpbf16-" in result.stdout
    assert entry["details"]["linear_kernels"].startswith("bfloat16 dpbf16-")


def test_the_table_names_int8_w8a8_as_cbruns_dtype_under_quantization(tiny_llama_dir, tmp_path, invoke, no_gemm_probe):
    out_json = tmp_path / "bench.json"
    args = ["--model", str(tiny_llama_dir), "--engine", "cbrun", "--dtype", "bfloat16", "--quantization", "int8"]
    result = invoke([*args, "--output-json", str(out_json), *SMALL])
    assert result.exit_code == 0, result.output
    entry = json.loads(out_json.read_text())["results"][0]
    assert entry["dtype"] == "int8 W8A8" and _row_dtype(result.stdout, "cbrun") == "int8 W8A8"
    assert "int8 W8A8 (every linear but the head)" in result.stdout


def test_plot_draws_the_engines_side_by_side(tiny_llama_dir, tmp_path, invoke, no_gemm_probe):
    pytest.importorskip("matplotlib")
    for name in ("bench.png", "bench.svg"):
        target = tmp_path / name
        result = invoke(["--model", str(tiny_llama_dir), "--engine", "cbrun", "--plot", str(target), *SMALL])
        assert result.exit_code == 0, result.output
        head = target.read_bytes()[:200]
        assert head.startswith(b"\x89PNG") if name.endswith(".png") else b"<svg" in head or b"<?xml" in head


def test_plot_caption_names_the_machine_model_and_dtypes():
    from cbrun.bench.plot import caption

    report = {
        "machine": {
            "cpu_model": "Test CPU",
            "cpu_cores": 2,
            "torch_threads": 2,
            "cpu_flags": {"avx2": True, "avx512_bf16": True, "amx_bf16": False},
            "torch": "2.13",
            "transformers": "5.24",
        },
        "config": {
            "model": "m",
            "workload": "random",
            "num_prompts": 3,
            "num_input_tokens": 30,
            "max_output_tokens": 9,
            "temperature": 1.0,
        },
    }
    text = caption(report)
    assert "Test CPU" in text and "avx512_bf16" in text and "amx_bf16" not in text and "model m" in text


def test_plot_and_vllm_dtype_and_random_models_are_checked_before_the_run(tiny_llama_dir, tmp_path, invoke):
    bad_plot = invoke(["--model", str(tiny_llama_dir), "--plot", str(tmp_path / "x.pdf"), *SMALL])
    assert bad_plot.exit_code == 2 and ".png or .svg" in bad_plot.stderr
    bad_dtype = invoke(["--model", str(tiny_llama_dir), "--vllm-dtype", "int8", *SMALL])
    assert bad_dtype.exit_code == 2 and "--vllm-dtype" in bad_dtype.stderr
    unknown = invoke(["--model", "random:gpt-9", *SMALL])
    assert unknown.exit_code == 2 and "qwen3-1.7b" in unknown.stderr


def test_a_random_model_of_a_real_shape_is_built_once_and_loads(tmp_path, monkeypatch, tiny_tokenizer):
    """random:NAME builds the architecture from its config with seeded weights, saved once for every engine
    (here a tiny stand-in shape, and the tiny tokenizer instead of SmolLM2's)."""
    import cbrun.models
    from cbrun.bench import random_model
    from cbrun.models import load_model

    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))
    monkeypatch.setitem(
        random_model.SHAPES,
        "tiny-test",
        (
            "qwen3",
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=256,
                tie_word_embeddings=True,
            ),
        ),
    )
    monkeypatch.setattr(cbrun.models, "load_model", lambda *a, **k: (None, tiny_tokenizer))
    first = random_model.random_model_dir("random:tiny-test")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert random_model.random_model_dir("random:tiny-test") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.undo()
    model, _ = load_model(str(first), dtype="bfloat16", device="cpu")
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 2


def test_several_models_plot_speed_and_peak_memory_against_size(
    tiny_llama_dir, tiny_qwen3_dir, tmp_path, invoke, no_gemm_probe
):
    """--model a,b runs each model in turn; the JSON holds one report per model with each engine's peak RSS and
    the model's size, and --plot draws throughput and memory against size."""
    pytest.importorskip("matplotlib")
    target, report = tmp_path / "sizes.png", tmp_path / "sizes.json"
    models = f"{tiny_llama_dir},{tiny_qwen3_dir}"
    result = invoke(
        ["--model", models, "--engine", "cbrun", "--plot", str(target), "--output-json", str(report), *SMALL]
    )
    assert result.exit_code == 0, result.output
    runs = json.loads(report.read_text())["runs"]
    assert [r["config"]["model_name"] for r in runs] == [str(tiny_llama_dir), str(tiny_qwen3_dir)]
    for run in runs:
        assert run["config"]["parameters"] > 0 and run["config"]["parameter_bytes"] > 0
        (entry,) = run["results"]
        assert entry["peak_rss_gb"] > 0.05  # at least the interpreter and torch
    assert target.read_bytes()[:8].startswith(b"\x89PNG")
    assert result.output.count("peak RSS") >= 2  # the column, in each model's table
