"""The bench's int8 GEMM probe (--quantization int8): measured beside bf16, and the fraction of it reported."""

from __future__ import annotations

import io

import pytest

from cbrun.bench.ceiling import measure_ceiling, measure_int8_gops
from cbrun.bench.report import build_report, print_report
from cbrun.bench.result import PeerResult
from cbrun.bench.runner import output_checks
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.models import load_model


@pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable (no C compiler)")
def test_the_int8_probe_measures_cbruns_kernel_and_torchs_beside_bf16(tiny_llama_dir):
    rates = measure_int8_gops([(256, 512), (512, 256)], rows=64, repeats=2)
    assert rates["cbrun"] > 0 and set(rates) == {"cbrun", "torch"}
    model, _ = load_model(str(tiny_llama_dir), dtype="bfloat16")
    plain = measure_ceiling(model, model.dtype)
    int8 = measure_ceiling(model, model.dtype, quantization="int8")
    assert "int8" not in plain["gemm_gflops"]
    probe = int8["gemm_gflops"]["int8"]
    assert probe["best"] == max(probe["model_shapes"], probe["square"], probe["torch_int_mm"]) > 0


def test_the_report_gives_the_fraction_of_the_int8_gemm():
    results = [PeerResult("cbrun", wall_s=2.0, num_requests=4, num_input_tokens=100, output_counts=[8] * 4)]
    ceiling = {
        "gflop_per_token": 0.269,
        "gemm_rows": 256,
        "reference_dtype": "bfloat16",
        "gemm_gflops": {"bfloat16": {"best": 500.0}, "int8": {"best": 1000.0}},
    }
    config = {"ignore_eos": True, "dtype_resolved": "bfloat16"}
    checks = output_checks(results, type("W", (), {"n": 1, "output_lens": [8] * 4, "ignore_eos": True})())
    report = build_report(config, {"device": "cpu"}, results, ceiling, checks, "bfloat16")
    cbrun = report["results"][0]
    assert cbrun["compute_ceiling_fraction_int8"] == pytest.approx((132 / 2.0) * 0.269 / 1000.0)
    out = io.StringIO()
    print_report(report, file=out)
    assert "of int8 GEMM (cbrun)" in out.getvalue() and "int8 1000.0" in out.getvalue()
