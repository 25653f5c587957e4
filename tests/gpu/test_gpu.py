"""The Triton backend end to end: greedy parity, sampling on the device, one device-to-host copy per step.

Tests marked `gpu` need CUDA and skip without it (scripts/gpu_check.sh runs them on a GPU machine with
`pytest -m gpu`). One test is not marked: it runs the engine with backend="triton" on CPU tensors under
Triton's interpreter, in a child process, so CI checks the backend's wiring (row plans, in-place page
reads, chunked prefill over cached prefixes) without a GPU. The child is needed because TRITON_INTERPRET
must be set before triton is first imported in a process, and torch or transformers may already have
imported it here (see tests/gpu/test_triton_attention.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from engine_helpers import random_prompts

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.models import load_model

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[2]


def gpu(test):
    """Mark a test `gpu` and skip it, saying why, where it cannot run."""
    reason = (
        (
            "no CUDA device (torch.cuda.is_available() is False): GPU tests run on a GPU machine, "
            "see scripts/gpu_check.sh"
        )
        if not HAS_CUDA
        else "triton is not installed"
    )
    return pytest.mark.gpu(pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason=reason)(test))


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    """Lengths across page boundaries; two pairs share a prefix longer than a page (prefix-cache hits)."""
    shared, longer = random_prompts(vocab, [20, 37], seed=seed + 1)
    plain = random_prompts(vocab, [1, 5, 16, 17, 40, 75], seed=seed)
    tails = random_prompts(vocab, [3, 12, 1, 30], seed=seed + 2)
    return plain + [shared + tails[0], shared + tails[1], longer + tails[2], longer + tails[3]]


@torch.inference_mode()
def _generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, num_beams=1
    )
    return out[0, len(prompt) :].tolist()


def _engine_greedy(model, tokenizer, prompts, max_tokens: int, backend: str) -> list:
    config = EngineConfig(backend=backend, page_size=16, num_blocks=256, max_batch_tokens=32)
    with Engine(model, tokenizer, config) as engine:
        if backend == "triton":
            assert engine.core.backend.name == "triton" and engine.core.backend.attends_rows, (
                engine.core.backend.describe()
            )
        return engine.generate_batch(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))


@pytest.fixture(scope="module")
def cuda_llama(tiny_llama_dir):
    if not (HAS_CUDA and HAS_TRITON):
        pytest.skip("needs CUDA and triton")
    return load_model(str(tiny_llama_dir), dtype="float32", device="cuda")


@gpu
@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_triton_greedy_matches_torch_backend_and_generate(model_dir, request):
    model, tokenizer = load_model(str(request.getfixturevalue(model_dir)), dtype="float32", device="cuda")
    prompts = _prompts(model.get_input_embeddings().weight.shape[0], seed=11)
    refs = [_generate(model, p, 24) for p in prompts]  # before any engine switches the model's attention
    triton_out = _engine_greedy(model, tokenizer, prompts, 24, "triton")
    torch_out = _engine_greedy(model, tokenizer, prompts, 24, "torch")
    for prompt, ref, tri, tor in zip(prompts, refs, triton_out, torch_out):
        assert tri.error is None and tor.error is None, (tri.error, tor.error)
        assert tri.token_ids == tor.token_ids, f"prompt of {len(prompt)} tokens: triton differs from torch"
        assert tri.token_ids == ref, f"prompt of {len(prompt)} tokens: triton differs from model.generate"
        assert tri.logprobs == pytest.approx(tor.logprobs, abs=1e-4)


@gpu
def test_seeded_samples_alone_and_in_a_crowd_on_device(cuda_llama, monkeypatch):
    """A seeded request with n=2 draws the same tokens alone and among others, and its tokens are chosen on the GPU."""
    from cbrun.engine.sample import sampler

    model, tokenizer = cuda_llama
    prompts = random_prompts(model.get_input_embeddings().weight.shape[0], [20 + 7 * i for i in range(24)], seed=5)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, n=2, ignore_eos=True)
    triton = dict(backend="triton", page_size=16)
    with Engine(model, tokenizer, EngineConfig(num_blocks=256, max_batch_tokens=4096, **triton)) as engine:
        alone = engine.generate_batch([prompts[0]], params)
    devices: list[str] = []
    to_host = sampler._to_host

    def recording_to_host(chosen, token_logprobs, top):
        devices.append(chosen.device.type)
        return to_host(chosen, token_logprobs, top)

    monkeypatch.setattr(sampler, "_to_host", recording_to_host)
    crowd_params = [SamplingParams(max_tokens=26, temperature=0.8, seed=i, ignore_eos=True) for i in range(23)]
    with Engine(model, tokenizer, EngineConfig(num_blocks=512, max_batch_tokens=37, **triton)) as engine:
        for i, prompt in enumerate(prompts[1:]):
            engine.add_request(prompt, crowd_params[i], request_id=f"other{i}")
        engine.add_request(prompts[0], params, request_id="target")
        crowd = sorted((engine.get_result("target", timeout=300) for _ in range(2)), key=lambda o: o.sample_index)
    assert [o.sample_index for o in alone] == [0, 1]
    assert all(o.error is None for o in alone + crowd)
    assert [o.token_ids for o in crowd] == [o.token_ids for o in alone]
    for a, c in zip(alone, crowd):
        assert c.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert alone[0].token_ids != alone[1].token_ids, "the two samples drew the same stream"
    assert devices and set(devices) == {"cuda"}, f"tokens were chosen on {set(devices)}"


@gpu
def test_decode_step_makes_one_device_to_host_copy(cuda_llama):
    """With CUDA's sync debug mode on "warn", a decode step raises exactly one synchronising-operation warning:
    the copy of the chosen ids and logprobs back to the host. Steps are driven on EngineCore directly, in this
    thread, so nothing else runs while the mode is on."""
    from cbrun.engine.core import EngineCore
    from cbrun.engine.request import Request

    model, tokenizer = cuda_llama
    core = EngineCore(model, tokenizer, EngineConfig(backend="triton", page_size=16, num_blocks=64))
    try:
        prompts = random_prompts(model.get_input_embeddings().weight.shape[0], [5, 18, 33, 2], seed=9)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        requests = [Request(f"r{i}", 0, prompt, params, seed=i, arrival_order=i) for i, prompt in enumerate(prompts)]
        for request in requests:
            core.add(request)
        for _ in range(3):  # prefill, then decodes: kernels compiled, cuBLAS and pinned pools warm
            core.step()
        before = [r.num_generated for r in requests]
        assert min(before) >= 2 and max(before) < params.max_tokens, before

        def synchronising(step):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            return result, [w for w in caught if "synchroniz" in str(w.message).lower()]

        _, probe = synchronising(lambda: torch.ones(1, device="cuda").item())
        if not probe:
            pytest.skip("torch.cuda.set_sync_debug_mode('warn') raised no Python warning for .item() here")
        _, syncs = synchronising(core.step)
        assert [r.num_generated for r in requests] == [n + 1 for n in before], "the step was not a decode of all"
        sites = "\n".join(f"{w.filename}:{w.lineno}: {w.message}" for w in syncs)
        assert len(syncs) == 1, f"{len(syncs)} synchronising operations in one decode step:\n{sites}"
    finally:
        core.close()


_INTERPRETER_CHILD = r"""
import json, sys
import torch
from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.models import load_model

directories, prompts, max_tokens = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
results = {}
for directory in directories:
    model, tokenizer = load_model(directory, dtype="float32", device="cpu")
    with torch.inference_mode():
        generate = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, num_beams=1)
            generate.append(out[0, len(prompt):].tolist())
    result = results[directory] = {"generate": generate}
    for backend in ("torch", "triton"):
        config = EngineConfig(backend=backend, page_size=16, num_blocks=64, max_batch_tokens=32)
        with Engine(model, tokenizer, config) as engine:
            result[backend + "_backend"] = engine.core.backend.describe()
            outs = engine.generate_batch(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        result[backend] = [[o.token_ids, o.logprobs, o.error] for o in outs]
print("RESULT " + json.dumps(results))
"""


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the CPU engine does not need it)")
def test_triton_backend_under_interpreter_matches_torch(tiny_llama_dir, tiny_qwen3_dir):
    """backend="triton" on CPU under TRITON_INTERPRET=1 (one child process) gives the torch backend's and
    model.generate's greedy tokens, on a tiny Llama (head_dim 16) and a tiny Qwen3 (head_dim 32, q/k norms)."""
    directories = [str(tiny_llama_dir), str(tiny_qwen3_dir)]
    prompts = _prompts(512, seed=3)[3:]  # 7 prompts of 17..75 tokens: chunked by the 32-token budget, 2 shared prefixes
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_CHILD, json.dumps(directories), json.dumps(prompts), "6"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-5000:]
    line = next((out for out in child.stdout.splitlines() if out.startswith("RESULT ")), None)
    assert line is not None, child.stdout[-3000:] + child.stderr[-3000:]
    results = json.loads(line.removeprefix("RESULT "))
    for directory in directories:
        result, name = results[directory], Path(directory).name
        assert "Triton paged attention on cpu" in result["triton_backend"], result["triton_backend"]
        for prompt, ref, (tri, tri_lp, tri_err), (tor, tor_lp, tor_err) in zip(
            prompts, result["generate"], result["triton"], result["torch"]
        ):
            assert tri_err is None and tor_err is None, (name, tri_err, tor_err)
            assert tri == tor, f"{name}, prompt of {len(prompt)} tokens: triton {tri} vs torch {tor}"
            assert tri == ref, f"{name}, prompt of {len(prompt)} tokens: triton {tri} vs model.generate {ref}"
            assert tri_lp == pytest.approx(tor_lp, abs=1e-4), name
