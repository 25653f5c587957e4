"""The compute-backend seam: which backend an engine gets, what the per-step batch carries, one host copy.

The engine core wires one backend object (cbrun/engine/backends/base.py); the step's PagedBatch holds tensors
and sizes only, and reaches an accelerator in one copy per dtype (device_copy.py). The Triton backend's
kernels and its end-to-end run under the interpreter are in test_triton_attention.py and test_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import random_prompts

from cbrun.engine import ConfigError, Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.base import BackendUnavailable, TorchBackend
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.selector import choose_backend
from cbrun.engine.backends.torch_attention import TorchMetadataBuilder
from cbrun.engine.model_spec import read_model_spec
from cbrun.engine.step.batch import HOST_ONLY, PagedBatch, SequenceRows
from cbrun.engine.step.device_copy import to_device
from cbrun.models import load_model

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable (no C compiler?)")


def _tiny(directory):
    model, tokenizer = load_model(str(directory), dtype="float32")
    return model, tokenizer, read_model_spec(model, tokenizer)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="backend must be one of"):
        EngineConfig(backend="vulkan")


@needs_kernels
def test_auto_on_cpu_is_the_compiled_backend_and_close_restores_the_model(tiny_llama_dir):
    model, _, spec = _tiny(tiny_llama_dir)
    linear = model.model.layers[0].self_attn.q_proj
    backend = choose_backend(model, "auto", spec)
    assert backend.name == "cpu" and backend.attends_rows
    assert linear in backend.linears and "forward" in vars(linear)
    assert len(backend.fused_layers) == model.config.num_hidden_layers
    backend.close()
    assert "forward" not in vars(linear) and "forward" not in vars(model.model.layers[0])


def test_torch_backend_patches_nothing(tiny_llama_dir):
    model, _, spec = _tiny(tiny_llama_dir)
    backend = choose_backend(model, "torch", spec)
    assert type(backend) is TorchBackend and isinstance(backend.metadata_builder, TorchMetadataBuilder)
    assert not any("forward" in vars(module) for module in model.modules())


def test_auto_without_compiled_kernels_falls_back_to_torch(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("CBRUN_KERNELS", "torch")
    model, _, spec = _tiny(tiny_llama_dir)
    assert choose_backend(model, "auto", spec).name == "torch"
    with pytest.raises(BackendUnavailable, match="compiled CPU kernels"):
        choose_backend(model, "cpu", spec)


def test_triton_on_cpu_without_the_interpreter_says_why(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, _, spec = _tiny(tiny_llama_dir)
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET"):
        choose_backend(model, "triton", spec)


def _step_batch(directory, backend: str) -> PagedBatch:
    """The PagedBatch of a first step over three prompts (built, not run) on a fresh engine core."""
    from cbrun.engine.core import EngineCore
    from cbrun.engine.request import Request

    model, tokenizer, _ = _tiny(directory)
    core = EngineCore(model, tokenizer, EngineConfig(backend=backend, num_blocks=64, max_batch_tokens=48))
    try:
        for index, prompt in enumerate(random_prompts(model.config.vocab_size, [5, 40, 17], seed=1)):
            core.add(Request(f"r{index}", 0, prompt, SamplingParams(max_tokens=4, temperature=0.0), 0, index))
        return core.builder.build(core.scheduler.schedule().items)
    finally:
        core.close()


def _fields(value, path="batch"):
    """(path, value) of every leaf a PagedBatch holds outside its host-only fields."""
    if dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            if field.metadata != HOST_ONLY:
                yield from _fields(getattr(value, field.name), f"{path}.{field.name}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _fields(item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _fields(item, f"{path}[{key!r}]")
    else:
        yield path, value


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_kernels), "torch"])
def test_the_step_batch_carries_tensors_and_sizes_only(tiny_llama_dir, backend):
    batch = _step_batch(tiny_llama_dir, backend)
    leaves = list(_fields(batch))
    assert any(isinstance(v, torch.Tensor) for _, v in leaves)
    odd = [
        (path, type(v).__name__) for path, v in leaves if not isinstance(v, (torch.Tensor, int, bool, str, type(None)))
    ]
    assert odd == [], f"the batch carries more than tensors and sizes: {odd}"


@needs_kernels
def test_one_copy_per_dtype_moves_every_index_tensor_and_leaves_host_fields(tiny_llama_dir):
    batch = _step_batch(tiny_llama_dir, "cpu")
    assert to_device(batch, torch.device("cpu")) is batch  # nothing moves on the CPU
    moved = to_device(batch, torch.device("meta"))  # a device that holds shapes only: no CUDA needed
    before = [(p, v) for p, v in _fields(batch) if isinstance(v, torch.Tensor)]
    after = {p: v for p, v in _fields(moved) if isinstance(v, torch.Tensor)}
    assert set(after) == {p for p, _ in before}
    for path, tensor in before:
        assert after[path].device.type == "meta" and after[path].shape == tensor.shape, path
        assert after[path].dtype == tensor.dtype, path
    bases = {id(after[p]._base) for p, t in before if t.dtype == torch.long}
    assert len(bases) == 1 and all(after[p]._base is not None for p, _ in before), (
        "the int64 tensors must be views of one buffer (one copy)"
    )
    offsets = {after[p].storage_offset() * 8 % 128 for p, t in before if t.dtype == torch.long}
    assert offsets == {0}, "each tensor starts on a 128-byte boundary (Triton specializes on alignment)"
    assert moved.sampled is batch.sampled and moved.store is batch.store  # host-only fields untouched


def test_triton_plan_cuts_rows_into_blocks_of_one_sequence():
    pytest.importorskip("triton")
    from cbrun.engine.backends.cuda.backend import CudaBackend

    backend = CudaBackend(torch.device("cpu"))
    backend.block_rows = 8
    seqs = [SequenceRows(0, 10, 1, [0], 0), SequenceRows(1, 0, 19, [1, 2], 0), SequenceRows(20, 5, 1, [3], 0)]
    blocks, rows = backend.plan_rows(seqs, 16, False)
    assert rows == 8  # the longest run (19 rows), capped at block_rows
    assert blocks.tolist() == [[0, 1], [1, 8], [9, 8], [17, 3], [20, 1]]
    decode = [SequenceRows(i, 30, 1, [i], 0) for i in range(4)]
    blocks, rows = backend.plan_rows(decode, 16, False)
    assert rows == 1 and blocks.tolist() == [[i, 1] for i in range(4)]  # decode-only: G heads per program
    three = [SequenceRows(0, 0, 3, [0], 0)]
    assert backend.plan_rows(three, 16, False)[1] == 4  # rounded up to a power of two (fewer compiles)


@needs_kernels
def test_cpu_and_torch_backends_agree_on_greedy_tokens(tiny_qwen3_dir):
    model, tokenizer, _ = _tiny(tiny_qwen3_dir)
    prompts = random_prompts(model.config.vocab_size, [3, 30, 70], seed=4)
    results = {}
    for backend in ("cpu", "torch"):
        config = EngineConfig(backend=backend, num_blocks=64, max_batch_tokens=32)
        with Engine(model, tokenizer, config) as engine:
            assert engine.core.backend.name == backend
            results[backend] = [
                o.token_ids for o in engine.generate_batch(prompts, SamplingParams(max_tokens=12, temperature=0.0))
            ]
    assert results["cpu"] == results["torch"]
