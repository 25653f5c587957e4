"""Hub ids download through huggingface_hub when not cached: tested against a local stand-in of the hub.

`FakeHub` is a small HTTP server speaking the part of the hub's API that
`huggingface_hub` uses to download a model (repo info, file tree, resolve
URLs), serving a tiny model's directory. huggingface_hub is pointed at it
with HF_ENDPOINT (read when it is imported, so in-process tests patch its
constants and the CLI test sets the variable for a subprocess), and every
request it receives is recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cbrun.models import ModelLoadError, hub_files_to_fetch, load_model

REPO = "tiny-org/tiny-llama"
GATED = "tiny-org/gated-llama"
TOKEN = "hf_test_token"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}
# Files a real repo often carries besides what loading needs; none of them may be fetched.
EXTRA_FILES = {
    "pytorch_model.bin": b"stale duplicate",
    "original/consolidated.pth": b"meta format",
    "tiny.Q4_0.gguf": b"GGUF",
    "README.md": b"# tiny",
}


class FakeHub:
    """Serves `files` (name -> bytes) as the model repos REPO and GATED (the latter only with TOKEN)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub.handle(self, body=True)

            def do_HEAD(self):
                hub.handle(self, body=False)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> set[str]:
        """Names of the files whose content was downloaded (GET on a resolve URL)."""
        return {
            m.group(1)
            for method, path, _ in self.requests
            if method == "GET"
            if (m := re.match(r"/[^/]+/[^/]+/resolve/[^/]+/(.+)", path))
        }

    def handle(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        auth = request.headers.get("Authorization")
        path = request.path.split("?")[0]
        self.requests.append((request.command, path, auth))
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path) or re.fullmatch(
            r"/([^/]+/[^/]+)/(resolve)/([^/]+)/(.+)", path
        )
        if match is None:
            return self.reply(request, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
        repo, kind, revision = match.group(1), match.group(2) or "revision", match.group(3) or "main"
        if repo not in (REPO, GATED):
            return self.reply(
                request, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body
            )
        if repo == GATED and auth != f"Bearer {TOKEN}":
            return self.reply(request, 403, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, body)
        commit = COMMITS.get(revision, revision if revision in COMMITS.values() else None)
        if commit is None:
            return self.reply(request, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, body)
        if kind == "revision":
            info = {
                "id": repo,
                "modelId": repo,
                "sha": commit,
                "private": False,
                "siblings": [{"rfilename": name} for name in sorted(self.files)],
            }
            return self.reply(request, 200, json.dumps(info).encode(), {}, body)
        if kind == "tree":
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                for name, data in sorted(self.files.items())
            ]
            return self.reply(request, 200, json.dumps(tree).encode(), {}, body)
        name = match.group(4)
        if name not in self.files:
            return self.reply(request, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
        data = self.files[name]
        return self.reply(request, 200, data, {"X-Repo-Commit": commit, "ETag": f'"{_oid(data)}"'}, body)

    @staticmethod
    def reply(request, status: int, data: bytes, headers: dict, body: bool) -> None:
        request.send_response(status)
        for key, value in {"Content-Length": str(len(data)), "Content-Type": "application/json", **headers}.items():
            request.send_header(key, value)
        request.end_headers()
        if body:
            request.wfile.write(data)


def _oid(data: bytes) -> str:
    """The git blob id, as the hub reports for a file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def fake_hub(tiny_llama_dir):
    files = {p.name: p.read_bytes() for p in Path(tiny_llama_dir).iterdir() if p.is_file()}
    hub = FakeHub({**files, **EXTRA_FILES})
    yield hub
    hub.close()


@pytest.fixture
def hub_env(fake_hub, tmp_path, monkeypatch):
    """huggingface_hub in this process pointed at `fake_hub`, with an empty cache and no token."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake_hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    return tmp_path / "hub"


def test_uncached_hub_id_downloads_what_loading_needs_and_nothing_else(fake_hub, hub_env, tiny_llama_dir):
    model, tokenizer = load_model(REPO, dtype="float32")

    assert model.config.model_type == "llama" and tokenizer.eos_token_id == 2
    assert fake_hub.fetched() == {p.name for p in Path(tiny_llama_dir).iterdir() if p.is_file()}
    snapshot = hub_env / "models--tiny-org--tiny-llama" / "snapshots" / COMMITS["main"]
    assert (snapshot / "model.safetensors").is_file()


def test_second_load_comes_from_the_cache_without_any_request(fake_hub, hub_env):
    load_model(REPO, dtype="float32")
    before = len(fake_hub.requests)

    load_model(REPO, dtype="float32")

    assert len(fake_hub.requests) == before


def test_interrupted_download_is_completed_not_taken_from_the_cache(fake_hub, hub_env):
    load_model(REPO, dtype="float32")
    snapshot = hub_env / "models--tiny-org--tiny-llama" / "snapshots" / COMMITS["main"]
    (snapshot / "model.safetensors").unlink()  # as if the weights never finished

    model, _ = load_model(REPO, dtype="float32")

    assert model.config.model_type == "llama" and (snapshot / "model.safetensors").is_file()


def test_revision_is_downloaded_and_cached_under_its_own_commit(fake_hub, hub_env):
    load_model(REPO, dtype="float32", revision="v1")

    assert (hub_env / "models--tiny-org--tiny-llama" / "snapshots" / COMMITS["v1"] / "config.json").is_file()
    assert any("/revision/v1" in path for _, path, _ in fake_hub.requests)
    with pytest.raises(ModelLoadError, match="has no revision 'nope'"):
        load_model(REPO, dtype="float32", revision="nope")


def test_gated_repo_needs_hf_token_and_says_so_in_one_line(fake_hub, hub_env, monkeypatch):
    with pytest.raises(ModelLoadError) as info:
        load_model(GATED, dtype="float32")
    assert "gated" in str(info.value) and "HF_TOKEN" in str(info.value) and "\n" not in str(info.value)

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model, _ = load_model(GATED, dtype="float32")

    assert model.config.model_type == "llama"
    assert fake_hub.requests[-1][2] == f"Bearer {TOKEN}"


def test_missing_repo_is_one_line_naming_the_hub(fake_hub, hub_env):
    with pytest.raises(ModelLoadError) as info:
        load_model("tiny-org/no-such-model")

    message = str(info.value)
    assert "the hub has no model repository 'tiny-org/no-such-model'" in message and "\n" not in message


def test_offline_mode_never_reaches_the_hub(fake_hub, hub_env, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        load_model(REPO)
    assert fake_hub.requests == []


def test_revision_is_refused_for_local_models(tiny_llama_dir):
    with pytest.raises(ModelLoadError, match="--revision applies to hub ids only"):
        load_model(tiny_llama_dir, revision="main")


def test_only_transformers_weights_are_chosen_from_a_repo_listing():
    listing = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "consolidated.safetensors",
        "pytorch_model.bin",
        "original/params.json",
        "onnx/model.onnx",
        "chat_template.jinja",
    ]

    assert hub_files_to_fetch(listing) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert hub_files_to_fetch(["config.json", "pytorch_model.bin"]) == ["config.json", "pytorch_model.bin"]


def test_cli_downloads_a_revision_with_a_progress_bar_on_stderr(fake_hub, tmp_path):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world"}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_ENDPOINT=fake_hub.url, HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "cbrun",
        "generate",
        str(prompts),
        str(tmp_path / "out.jsonl"),
        "--model",
        REPO,
        "--revision",
        "v1",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--dtype",
        "float32",
    ]

    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert row["error"] is None and row["num_completion_tokens"] > 0
    assert "Fetching" in done.stderr and "100%" in done.stderr  # huggingface_hub's bar
    assert (tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMITS["v1"]).is_dir()
