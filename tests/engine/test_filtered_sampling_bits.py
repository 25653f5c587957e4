"""Filtered sampling (top-k, top-p, min-p) gives the same draws on every CPU (the compiled path).

The sampler's cuts used torch's softmax, sort order and cumsum, which ATen vectorizes by the CPU's ISA (it picks
AVX-512, AVX2 or plain loops at run time): a seeded top-p draw of SmolLM2 in bf16 landed on another token on an
AVX2 machine than on the AVX-512 one that wrote tests/fixtures/reference_bits.json (test_reference_bits.py
caught it). The cuts now come from values that no sort order changes and from sums in sampling.c, and the draw
is the kernel's. Here the same draws run under each of ATen's kernel sets this CPU has (ATEN_CPU_CAPABILITY:
plain, AVX2, and AVX-512 where the CPU has it) and must come out equal; on an AVX2-only CPU the plain and AVX2
sets happen to agree on the old path too, so the check that bites there is the reference file's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable (no C compiler)")

_DRAWS = """
import json, sys, torch
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.request import Request
from cbrun.engine.sample.sampler import sample
from cbrun.engine.sampling_params import SamplingParams
g = torch.Generator().manual_seed(3)
logits = torch.randint(-2**21, 2**21, (24, 4099), generator=g).float() / 2**18  # exact: randn vectorizes by ISA
params = [SamplingParams(temperature=0.7 + 0.05 * i, top_p=0.5 + 0.02 * i, top_k=(0, 40)[i % 2],
                         min_p=(0.0, 0.01)[i % 3 == 0], seed=i) for i in range(24)]
requests = [Request(str(i), 0, [1, 2], p, p.seed, i) for i, p in enumerate(params)]
got = sample(logits, requests, load_cpu_kernels())
print(json.dumps([got.token_ids, [float(v).hex() for v in got.logprobs]]))
"""


def _draws(capability: str) -> list:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", _DRAWS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_filtered_draws_do_not_depend_on_the_isa_torch_runs():
    from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags

    flags = set(cpu_flags().split())
    capabilities = ["default", "avx2"] + (["avx512"] if {"avx512f", "avx512bw", "avx512vl"} <= flags else [])
    draws = [_draws(capability) for capability in capabilities]
    assert all(d == draws[0] for d in draws[1:])
    assert len(set(draws[0][0])) > 1


def test_top_p_counts_match_a_float64_reference_away_from_the_cut():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(40, 1000, generator=g) * torch.linspace(0.5, 6, 40)[:, None]
    logprobs = torch.log_softmax(logits, dim=-1)
    logprobs[::7, 900:] = -math.inf  # dropped by an earlier filter
    sorted_lp = torch.sort(logprobs, dim=-1, descending=True).values
    ps = torch.linspace(0.05, 0.99, 40)
    counts = kernels.top_p_counts(sorted_lp, ps)
    probs = sorted_lp.double().exp()
    before = torch.cumsum(probs, dim=-1) - probs  # [n, V] mass before each position
    total = probs.sum(dim=-1, keepdim=True)
    want = (before < ps.double()[:, None] * total).sum(dim=-1).clamp(min=1)
    margin = (before - ps.double()[:, None] * total).abs().min(dim=-1).values  # how close the cut is
    clear = margin > 1e-5
    assert clear.sum() > 30
    assert torch.equal(counts[clear], want[clear])
    assert int(counts.min()) >= 1 and int(counts.max()) <= 1000
