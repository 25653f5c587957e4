"""The same bits on every CPU: a fixed job recomputed bitwise against a file written on another machine.

tests/fixtures/reference_bits.json holds the token ids and the logprobs' bit
patterns of a fixed job (token-id prompts; greedy and seeded sampling; fp32 and
bf16; the tiny Llama and, in the slow tier, SmolLM2-135M; the tiny Llama in int8
W8A8 too), computed with the portable kernels. This test recomputes it on whatever CPU runs the suite and
compares bit for bit: an AVX2 machine (the pair-dot twin, 8-lane fp32 kernels)
must match the AVX-512 machine that wrote the file, and vice versa; in int8, the
AVX2 variant (vpmaddwd) must match the VNNI or AMX one that wrote it.

When the arithmetic changes on purpose, rewrite the file and say so in the
commit: CBRUN_WRITE_REFERENCE=1 python -m pytest tests/cpu_kernels/test_reference_bits.py
(the real model's entries too: plain pytest runs the slow tier).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.models import load_model

REFERENCE = Path(__file__).parents[1] / "fixtures" / "reference_bits.json"
WRITE = os.environ.get("CBRUN_WRITE_REFERENCE") == "1"
PROMPTS = [[1, 5, 17, 200, 33, 90, 4], [1, 300, 12, 12, 12, 8], [1] + list(range(40, 100, 3)), [1, 7]]
SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0),
    "seeded": SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2, top_p=0.95),
}

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="the compiled CPU kernels cannot be built here")


def _bits(value: float) -> str:
    """An fp32 logprob's bit pattern as 8 hex digits."""
    return struct.pack(">f", value).hex()


def _job(model, tokenizer, quantization=None) -> dict:
    """{sampling name: [[tokens, logprob bits] per (prompt, sample)]} for the fixed job, in request order."""
    results = {}
    for name, sampling in SAMPLINGS.items():
        config = EngineConfig(num_blocks=64, kernels="portable", quantization=quantization)
        with Engine(model, tokenizer, config) as engine:
            outputs = engine.generate_batch([list(p) for p in PROMPTS], sampling)
        results[name] = [[list(map(int, out.token_ids)), [_bits(lp) for lp in out.logprobs]] for out in outputs]
    return results


def _check(key: str, model, tokenizer, quantization=None) -> None:
    got = _job(model, tokenizer, quantization)
    stored = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    if WRITE:
        stored[key] = got
        REFERENCE.parent.mkdir(exist_ok=True)
        REFERENCE.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        return
    assert key in stored, f"{key} missing from {REFERENCE.name}: write it with CBRUN_WRITE_REFERENCE=1"
    for name, expected in stored[key].items():
        assert got[name] == expected, f"{key} {name}: not the reference bits"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_job_gives_the_reference_bits(tiny_llama_dir, dtype):
    _check(f"tiny-llama/{dtype}", *load_model(str(tiny_llama_dir), dtype=dtype, device="cpu"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_int8_job_gives_the_reference_bits(tiny_llama_dir, dtype):
    _check(f"tiny-llama/{dtype}/int8", *load_model(str(tiny_llama_dir), dtype=dtype, device="cpu"), "int8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_job_gives_the_reference_bits(smollm2_loader, dtype):
    _check(f"smollm2-135m/{dtype}", *smollm2_loader(dtype))


_AVX2_RUN = """
import sys
sys.path[:0] = [{here!r}, {tests!r}]  # this file, and the helpers in tests/
import torch
from cbrun.engine.backends.cpu.linear import method_selector
from cbrun.engine.backends.cpu.linear.methods import DP_TWIN, F32
from cbrun.engine.backends.cpu.linear.int8 import INT8_AVX2
method_selector._CANDIDATES[("portable", torch.bfloat16)] = [DP_TWIN]  # as on a CPU without AVX512-BF16
method_selector._CANDIDATES[("portable", torch.int8)] = [INT8_AVX2]  # as on a CPU without VNNI or AMX
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
assert load_cpu_kernels().vector_width == 8, "not the AVX2 build"
from cbrun.models import load_model
import test_reference_bits as ref
quantization = {quantization!r}
key = "tiny-llama/" + {dtype!r} + ("/" + quantization if quantization else "")
ref._check(key, *load_model({model!r}, dtype={dtype!r}, device="cpu"), quantization)
"""


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
@pytest.mark.skipif("avx512f" not in cpu_flags().split(), reason="this CPU runs the AVX2 build: the tests above")
@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_avx2_build_on_this_cpu_gives_the_reference_bits(tiny_llama_dir, dtype, quantization, avx2_kernel_cache):
    """The kernels built for AVX2 (8 lanes, the pair-dot twin, int8 on vpmaddwd) and torch held to AVX2 give the
    same bits as the native AVX-512 build: what an AVX2-only machine computes, checked on this one."""
    if WRITE:
        pytest.skip("writing the reference")
    env = dict(
        os.environ, CBRUN_KERNEL_MARCH="x86-64-v3", ATEN_CPU_CAPABILITY="avx2", CBRUN_CACHE=str(avx2_kernel_cache)
    )
    script = _AVX2_RUN.format(
        here=str(Path(__file__).parent),
        tests=str(Path(__file__).parents[1]),
        dtype=dtype,
        model=str(tiny_llama_dir),
        quantization=quantization,
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
