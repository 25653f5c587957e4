"""`cbrun bench` on a structured workload: constraints reach the engines, every completed row is
checked independently, `cbrun-free` runs the same prompts unconstrained, vLLM gets the same constraints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cbrun.bench.runner as bench_runner
from cbrun.bench.dataset import dataset_workload
from cbrun.bench.peers.vllm_child import structured_kwargs
from cbrun.bench.peers.vllm_peer import _pass_spec
from cbrun.bench.structured import Validity, is_valid, vllm_constraint
from cbrun.cli.app import main
from cbrun.engine import StructuredSpec

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "examples" / "bench" / "w_structured.jsonl"
FIXED_CEILING = {
    "gflop_per_token": 0.001,
    "gemm_rows": 256,
    "reference_dtype": "bfloat16",
    "gemm_gflops": {"bfloat16": {"best": 100.0}, "float32": {"best": 50.0}},
}


def _small_dataset(path: Path) -> Path:
    shipped = [json.loads(line) for line in SHIPPED.read_text().splitlines()[:4]]
    extra = [
        {"id": "code", "prompt": "a code", "regex": "[A-Z]{2}[0-9]{2}", "max_tokens": 16},
        {"id": "pick", "prompt": "pick one", "choice": ["red", "green"], "max_tokens": 8},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in shipped + extra))
    return path


def test_structured_bench_checks_every_row_and_runs_the_free_baseline(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_runner, "measure_ceiling", lambda model, dtype, device, quantization=None: FIXED_CEILING)
    out_json = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--model",
            str(tiny_llama_dir),
            "--engine",
            "cbrun,cbrun-free",
            "--dataset-path",
            str(_small_dataset(tmp_path / "w.jsonl")),
            "--temperature",
            "0",
            "--num-blocks",
            "128",
            "--output-json",
            str(out_json),
            "--quiet",
        ]
    )
    assert code == 0
    entries = {e["engine"]: e for e in json.loads(out_json.read_text())["results"]}
    assert set(entries) == {"cbrun", "cbrun-free"}
    assert all(e["status"] == "ok" for e in entries.values())
    checked = entries["cbrun"]["details"]["structured"]
    assert checked["rows"] == 6 and checked["invalid"] == 0
    assert checked["valid"] + checked["incomplete"] == 6 and checked["valid"] >= 2  # regex and choice complete
    assert any(note.startswith("structured: ") for note in entries["cbrun"]["notes"])
    assert "structured" not in entries["cbrun-free"]["details"]


def test_shipped_structured_dataset_is_one_schema_with_enum_and_free_text_fields(tiny_llama_dir):
    from cbrun.models import load_model

    _, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    workload, skipped = dataset_workload(SHIPPED, tokenizer, output_len=64, max_context=2048, vocab_size=512)
    assert not skipped and workload.num_prompts == 96 and workload.is_structured
    specs = set(workload.structured)
    assert len(specs) == 1
    schema = json.loads(next(iter(specs)).value)
    kinds = {name: ("enum" if "enum" in field else field["type"]) for name, field in schema["properties"].items()}
    assert "enum" in kinds.values() and "string" in kinds.values()
    assert _pass_spec(workload)["structured"][0] == {"json": schema}


def test_validity_counts_incomplete_apart_from_invalid():
    spec = StructuredSpec("json_schema", {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]})
    validity = Validity()
    validity.add(spec, '{"a":1}', "stop")
    validity.add(spec, '{"a":', "length")
    validity.add(spec, '{"a":2}', "stop")
    assert validity.as_dict() == {"rows": 3, "valid": 1, "incomplete": 1, "invalid": 1}
    assert is_valid(StructuredSpec("choice", ["x"]), "x") and not is_valid(StructuredSpec("regex", "a+"), "ab")
    assert vllm_constraint(StructuredSpec("choice", ["x", "y"])) == {"choice": ["x", "y"]}
    assert vllm_constraint(None) is None and structured_kwargs(None) == {}


def test_vllm_gets_structured_outputs_params_when_installed():
    pytest.importorskip("vllm")
    params = structured_kwargs({"regex": "[a-z]+"})
    assert list(params) in (["structured_outputs"], ["guided_decoding"])
