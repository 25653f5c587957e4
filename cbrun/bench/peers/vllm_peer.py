"""Peer `vllm`: vLLM's offline `LLM.generate`, in-process or under a separate interpreter.

vLLM pins its own torch and transformers, so it usually lives in its own
environment: `--vllm-python PATH` names that interpreter, and the job runs in
`vllm_child.py` (stdlib + vLLM only), exchanging JSON files. Without the flag,
vLLM runs in-process when importable; otherwise the peer is unavailable.

vLLM loads a Hugging Face model directory. A local HF directory is passed as
is; any other model (a .gguf file, the default alias) is saved once, in the
run's dtype, with its tokenizer, to a cache directory that vLLM then loads.
Its start-up is excluded from timing, as every engine's is.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbrun.bench.peers import PeerContext, vllm_child
from cbrun.bench.result import PeerResult, PeerUnavailable
from cbrun.bench.structured import Validity, vllm_constraint
from cbrun.bench.workload import Workload

if TYPE_CHECKING:
    import torch

LOG_TAIL_LINES = 30
MIN_KV_BYTES = 512 << 20
MAX_KV_BYTES = 4 << 30


def run(ctx: PeerContext, workload: Workload, warmup: Workload) -> PeerResult:
    python = _interpreter(ctx.vllm_python)
    model_dir = model_dir_for_vllm(ctx)
    job: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": ctx.vllm_dtype,  # "auto": vLLM picks, as a user who runs it as installed gets
        "seed": workload.seed,
        "max_model_len": max(workload.max_total_len, warmup.max_total_len),
        "warmup": _pass_spec(warmup),
        "timed": _pass_spec(workload),
        "llm_kwargs": {},
    }
    env = vllm_environment(ctx.device, ctx.threads)
    if "VLLM_CPU_KVCACHE_SPACE" not in env:  # vLLM would reserve 92% of the memory node and refuse to start
        job["llm_kwargs"]["kv_cache_memory_bytes"] = kv_cache_bytes(ctx.model, _torch_dtype(ctx), workload)
    where = "in-process" if python is None else python
    ctx.progress.message(
        f"[vllm] starting vLLM ({where}; start-up takes minutes), "
        f"threads bind {env.get('VLLM_CPU_OMP_THREADS_BIND', '-')}"
    )
    figures = _run_in_process(job, env) if python is None else _run_child(python, job, env, ctx)
    result = PeerResult(
        "vllm",
        dtype=figures.get("dtype") or ctx.vllm_dtype,
        wall_s=figures["wall_s"],
        num_requests=workload.num_prompts,
        num_input_tokens=workload.num_input_tokens,
        output_counts=list(figures["output_counts"]),
        ttfts=list(figures["ttfts"]),
    )
    result.details.update(
        vllm_version=figures.get("vllm_version"),
        startup_s=round(figures.get("startup_s", 0.0), 2),
        model_dir=str(model_dir),
        python=where,
        threads_bind=env.get("VLLM_CPU_OMP_THREADS_BIND"),
    )
    result.notes.append(
        f"vLLM {figures.get('vllm_version')} ({where}), start-up {figures.get('startup_s', 0):.0f}s excluded"
    )
    if workload.is_structured and figures.get("outputs") is not None:  # checked here, as cbrun's are
        validity = Validity()
        for index, samples in enumerate(figures["outputs"]):
            spec = workload.constraint(index)
            if spec is None:
                continue
            for text, reason in samples:
                validity.add(spec, text, reason)
        result.notes.append(validity.note())
        result.details["structured"] = validity.as_dict()
    return result


def _torch_dtype(ctx: PeerContext) -> torch.dtype:
    """The dtype vLLM will compute in as far as the parent can tell (for sizing its KV cache)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        ctx.vllm_dtype, torch.bfloat16
    )  # auto: vLLM's CPU and GPU default for these checkpoints


def _interpreter(vllm_python: str | None) -> str | None:
    """The interpreter to run the child with, None for in-process; PeerUnavailable when there is neither."""
    if vllm_python:
        if not (os.path.isfile(vllm_python) and os.access(vllm_python, os.X_OK)):
            raise PeerUnavailable(f"--vllm-python {vllm_python} is not an executable file")
        return vllm_python
    if importlib.util.find_spec("vllm") is None:
        raise PeerUnavailable("vLLM is not importable here and --vllm-python was not given")
    return None


def _pass_spec(workload: Workload) -> dict:
    return {
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
        "n": workload.n,
        "ignore_eos": workload.ignore_eos,
        "temperature": workload.temperature,
        "seed": workload.seed,
        "structured": (
            [vllm_constraint(workload.constraint(i)) for i in range(workload.num_prompts)]
            if workload.is_structured
            else None
        ),
    }


def kv_cache_bytes(model: Any, dtype: torch.dtype, workload: Workload) -> int:
    """KV memory for every request of the workload at once (the most vLLM could use), within [512 MiB, 4 GiB]."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = getattr(dtype, "itemsize", 4)
    per_token = 2 * config.num_hidden_layers * heads * head_dim * itemsize
    tokens = sum(len(p) + workload.n * o for p, o in zip(workload.prompts, workload.output_lens))
    return int(min(MAX_KV_BYTES, max(MIN_KV_BYTES, 1.1 * tokens * per_token)))


def vllm_environment(device: str, threads: int | None = None) -> dict:
    """The child's environment: offline, and on CPU computing on `threads` cores (default all) unless the
    user chose a binding (vLLM's CPU build uses one core by default)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not str(device).startswith("cuda"):
        cores = threads or os.cpu_count() or 1
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}" if cores > 1 else "0")
    return env


def model_dir_for_vllm(ctx: PeerContext) -> Path:
    """A Hugging Face model directory vLLM can load: the user's own, or a cached export of the loaded model."""
    from cbrun.models import cache_dir

    spec = Path(ctx.model_spec).expanduser()
    if spec.is_dir() and (spec / "config.json").is_file() and any(spec.glob("*.safetensors")):
        return spec
    dtype = str(ctx.dtype).removeprefix("torch.")
    key = hashlib.sha256(f"{spec.resolve() if spec.exists() else ctx.model_spec}|{dtype}".encode()).hexdigest()[:16]
    target = cache_dir() / "vllm-models" / key
    if (target / "config.json").is_file() and (target / "COMPLETE").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=target.parent))
    ctx.model.save_pretrained(tmp)
    ctx.tokenizer.save_pretrained(tmp)
    (tmp / "COMPLETE").write_text(f"{ctx.model_spec}\n{dtype}\n")
    with contextlib.suppress(OSError):  # another run exported it meanwhile
        tmp.rename(target)
    return target


def _run_in_process(job: dict, env: dict) -> dict:
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_CPU_OMP_THREADS_BIND"):
        if key in env:
            os.environ.setdefault(key, env[key])
    return vllm_child.run(job)


def _run_child(python: str, job: dict, env: dict, ctx: PeerContext) -> dict:
    """Run vllm_child.py under `python`, relaying its progress lines; its full log is kept for errors."""
    with tempfile.TemporaryDirectory(prefix="cbrun-vllm-") as tmp:
        job_path, result_path = Path(tmp, "job.json"), Path(tmp, "result.json")
        job_path.write_text(json.dumps(job))
        log: list[str] = []
        proc = subprocess.Popen(
            [python, vllm_child.__file__, str(job_path), str(result_path)],
            env=env,
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line.rstrip())
            if line.startswith("[vllm] "):
                ctx.progress.message(line.rstrip())
        code = proc.wait()
        if code == vllm_child.EXIT_IMPORT_ERROR:
            raise PeerUnavailable(f"{python} cannot import vllm: {log[-1] if log else 'no output'}")
        if code != 0 or not result_path.is_file():
            raise RuntimeError(f"vLLM child exited with code {code}: {_root_cause(log)}\nfull log: {_keep_log(log)}")
        return json.loads(result_path.read_text())


def _root_cause(log: list[str]) -> str:
    """The first line that names an error (vLLM's last lines only say "see root cause above")."""
    for line in log:
        text = line.split("] ", 1)[-1].strip()
        if text.split(":", 1)[0].endswith(("Error", "Exception")) and "see root cause" not in text.lower():
            return text
    return "\n".join(log[-LOG_TAIL_LINES:])


def _keep_log(log: list[str]) -> Path:
    from cbrun.models import cache_dir

    path = cache_dir() / "vllm-last-failure.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(log) + "\n")
    return path
