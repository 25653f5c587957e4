"""`cbrun info` and `cbrun --version`: what a user pastes into a bug report, and the --kernels option."""

from __future__ import annotations

import json

import pytest

from cbrun.cli.app import main
from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"cbrun {version('cbrun')}"


@pytest.mark.skipif(load_cpu_kernels() is None, reason="the compiled CPU kernels cannot be built here")
def test_info_names_the_cpu_the_build_each_dtypes_method_and_what_auto_picks(capsys):
    has_bf16 = "avx512_bf16" in cpu_flags().split()
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) >= {"versions", "cpu", "kernels", "linear_methods", "dtype_auto_cpu"}
    assert set(info["versions"]) >= {"cbrun", "torch", "transformers"}
    assert info["kernels"]["built"] and info["kernels"]["linear_vector_lanes"] in (8, 16)
    assert info["kernels"]["bf16_attention"] in ("amx", "isa", "twin", "scalar")
    assert info["linear_methods"]["float32"]["method"] == "f32"
    bf16 = info["linear_methods"]["bfloat16"]
    assert bf16["method"] == ("dpbf16-isa" if has_bf16 else "dpbf16-twin") and bf16["same_bits_on_every_cpu"]
    assert all(check["passed"] for check in bf16["checks"] if check["method"] == bf16["method"])
    auto = info["dtype_auto_cpu"]["dtype"]
    assert auto == ("bfloat16" if has_bf16 or "amx_bf16" in cpu_flags().split() else "float32")
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for word in ("CPU", "ISA", "kernels", "float32", "bfloat16", "dtype auto", bf16["method"]):
        assert word in text


def test_kernels_option_reaches_the_engine_config_and_is_checked():
    from cbrun.cli.common import CliError, build_engine_config

    assert build_engine_config(kernels="fastest").kernels == "fastest"
    assert build_engine_config().kernels == "portable"
    with pytest.raises(CliError, match="kernels must be one of portable, fastest"):
        build_engine_config(kernels="quick")


def test_info_refuses_an_unknown_policy(capsys):
    assert main(["info", "--kernels", "quick"]) == 2
    assert "--kernels must be portable or fastest" in capsys.readouterr().err


@pytest.mark.skipif(load_cpu_kernels() is None, reason="the compiled CPU kernels cannot be built here")
def test_info_with_a_model_reports_the_bytes_held_for_its_weights_and_the_peak_rss(capsys, tiny_qwen3_dir):
    assert main(["info", "--json", "--model", str(tiny_qwen3_dir), "--dtype", "bfloat16"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["dtype"] == "bfloat16" and model["parameter_bytes"] > 0
    assert model["parameter_bytes"] <= model["weight_bytes_held"] <= 1.35 * model["parameter_bytes"]  # tiny: padding
    assert model["peak_rss_bytes"] > model["weight_bytes_held"] and model["load_seconds"] >= 0
    assert main(["info", "--model", str(tiny_qwen3_dir), "--dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "of parameters" in text and "held for them" in text and "peak RSS" in text
    assert main(["info", "--model", "/no/such/model"]) == 2


def test_info_takes_the_benchs_random_shapes(capsys, monkeypatch, tiny_qwen3_dir):
    import cbrun.bench.random_model as random_model

    assert main(["info", "--model", "random:no-such-shape"]) == 2
    assert "unknown random model 'no-such-shape'" in capsys.readouterr().err
    monkeypatch.setattr(random_model, "random_model_dir", lambda spec: tiny_qwen3_dir)  # built, as bench would
    assert main(["info", "--json", "--model", "random:qwen3-0.6b", "--dtype", "bfloat16"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["model"] == "random:qwen3-0.6b" and model["parameter_bytes"] > 0
