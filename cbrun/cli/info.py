"""`cbrun info`: what this machine will run, in the words a bug report needs.

The CPU and its flags, the kernel build, the linear method each dtype gets
with its self-check outcome, what `--dtype auto` picks, threads, and the
versions of cbrun, torch and transformers. The self-checks run at the default
model's shapes (cached, so a second call is instant); a model's own shapes are
checked when an engine loads it, and the run summary names the methods used.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from typing import Annotated, Optional, TextIO

import typer

_DEFAULT_MODEL_SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # (N, K) of SmolLM2-135M
_ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
)


def version_text() -> str:
    return f"cbrun {_version('cbrun')}"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def gather(policy: str = "portable") -> dict:
    """Everything `cbrun info` shows, as one JSON-able dict."""
    import torch

    from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags, cpu_model
    from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels

    flags = set(cpu_flags().split())
    info: dict = {
        "versions": {
            "cbrun": _version("cbrun"),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "python": platform.python_version(),
        },
        "cpu": {
            "model": cpu_model() or "unknown",
            "machine": platform.machine(),
            "isa": [flag for flag in _ISA_FLAGS if flag in flags],
            "threads": torch.get_num_threads(),
        },
        "kernels": None,
        "linear_methods": {},
    }
    kernels = load_cpu_kernels()
    if kernels is None:
        info["kernels"] = {"built": False, "why": "no C compiler, a failed build, or CBRUN_KERNELS=torch"}
    else:
        from cbrun.engine.backends.cpu.linear.method_selector import bf16_dot_products_here, choose_linear_method
        from cbrun.engine.backends.cpu.linear.self_check import Shape, cache_path

        info["kernels"] = {
            "built": True,
            "build": kernels.build_name,
            "linear_vector_lanes": kernels.vector_width,
            "bf16_attention": kernels.attend_dp_variant,  # AMX's order (attention_tile.h): amx, isa, twin or scalar
            "self_check_cache": str(cache_path()),
            "policy": policy,
        }
        shapes = [Shape(n, k) for n, k in _DEFAULT_MODEL_SHAPES]
        for dtype in (torch.float32, torch.bfloat16, torch.int8):  # int8: --quantization int8, all but the head
            choice = choose_linear_method(kernels, dtype, shapes if dtype != torch.int8 else shapes[:-1], policy)
            info["linear_methods"][str(dtype).removeprefix("torch.")] = {
                "method": choice.method.name if choice.method else None,
                "same_bits_on_every_cpu": bool(choice.method and choice.method.portable),
                "checks": [
                    {
                        "method": c.method,
                        "passed": c.passed,
                        "detail": c.detail,
                        "cached": c.cached,
                        "seconds": round(c.seconds, 3),
                    }
                    for c in choice.checks
                ],
            }
        ready, why = bf16_dot_products_here()
        info["dtype_auto_cpu"] = {"dtype": "bfloat16" if ready else "float32", "why": why}
    return info


def gather_model(spec: str, dtype: str, policy: str = "portable", quantization: str | None = None) -> dict:
    """What a model costs here: its parameters' bytes, the bytes the engine holds for them once started (the CPU
    backend's packed matrices and what the model keeps), load and start-up seconds, and the peak RSS."""
    import time

    from cbrun.engine import Engine, EngineConfig
    from cbrun.models import load_model
    from cbrun.process_memory import peak_rss_bytes

    started = time.perf_counter()
    model, tokenizer = load_model(spec, dtype, "cpu")
    loaded = time.perf_counter()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    config = EngineConfig(num_blocks=16, kernels=policy, quantization=quantization)  # type: ignore[arg-type]
    with Engine(model, tokenizer, config) as engine:
        ready = time.perf_counter()
        held = engine.weight_bytes()
        linear_kernels = engine.linear_kernels()
    return {
        "model": spec,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "parameter_bytes": parameters,
        "weight_bytes_held": held,
        "load_seconds": round(loaded - started, 2),
        "engine_start_seconds": round(ready - loaded, 2),
        "peak_rss_bytes": peak_rss_bytes(),
        "linear_kernels": linear_kernels,
    }


def info(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
    kernels: Annotated[str, typer.Option(help="The kernel policy to show: portable or fastest.")] = "portable",
    model: Annotated[
        Optional[str],
        typer.Option(
            "--model",
            "-m",
            help="Also load this model and start an engine on it: bytes of its parameters and of the weights held, "
            "load and start-up time, peak RSS. Takes bench's random shapes too (random:llama-3.1-8b).",
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="The dtype to load --model in (as generate's --dtype).")] = "auto",
    quantization: Annotated[
        Optional[str], typer.Option(help="Start --model's engine with this quantization (int8), as generate's.")
    ] = None,
) -> int:
    """Show the CPU, the kernel build, each dtype's linear method and its self-check, and versions (with --model,
    what that model costs here)."""
    from cbrun.cli.common import CliError

    if kernels not in ("portable", "fastest"):
        raise CliError(f"--kernels must be portable or fastest, got {kernels!r}")
    if quantization not in (None, "int8"):
        raise CliError(f"--quantization must be int8, got {quantization!r}")
    data = gather(kernels)
    if model is not None:
        data["model"] = _gather_model_or_fail(model, dtype, kernels, quantization)
    if as_json:
        print(json.dumps(data, indent=2))
        return 0
    out = sys.stdout
    versions = data["versions"]
    print(
        f"cbrun {versions['cbrun']}  (torch {versions['torch']}, transformers {versions['transformers']}, "
        f"python {versions['python']})",
        file=out,
    )
    cpu = data["cpu"]
    print(f"CPU        {cpu['model']} ({cpu['machine']}), {cpu['threads']} threads", file=out)
    print(f"ISA        {' '.join(cpu['isa']) or 'none of note'}", file=out)
    built = data["kernels"]
    if not built["built"]:
        print(f"kernels    not built: {built['why']} (the torch reference paths run)", file=out)
        return 0
    print(
        f"kernels    {built['build']} ({built['linear_vector_lanes']}-lane linear), policy {built['policy']}", file=out
    )
    attention = {"amx": "AMX tiles", "isa": "vdpbf16ps", "twin": "vector FMAs", "scalar": "the plain-C reference"}[
        built["bf16_attention"]
    ]
    print(
        f"{'':<11}bf16 attention: AMX's order on {attention} (checked at load; same bits on every CPU)",
        file=out,
    )
    for dtype, method in data["linear_methods"].items():
        name = method["method"] or "none passed"
        bits = "same bits on every CPU" if method["same_bits_on_every_cpu"] else "this CPU's own bits"
        what = ", --quantization int8: every linear but the head (W8A8)" if dtype == "int8" else ""
        print(f"{dtype:<10} {name} ({bits}{what})", file=out)
        for check in method["checks"]:
            cost = "cached" if check["cached"] else f"{check['seconds']:.2f} s"
            print(
                f"{'':<12}{'pass' if check['passed'] else 'FAIL'} {check['method']}: {check['detail']} ({cost})",
                file=out,
            )
    auto = data["dtype_auto_cpu"]
    print(f"dtype auto {auto['dtype']} on CPU: {auto['why']}", file=out)
    print(f"cache      {built['self_check_cache']}", file=out)
    if "model" in data:
        _print_model(data["model"], out)
    return 0


def _gather_model_or_fail(spec: str, dtype: str, policy: str, quantization: str | None) -> dict:
    from cbrun.bench.random_model import RandomModelError, is_random, random_model_dir
    from cbrun.cli.common import CliError, first_line
    from cbrun.models import ModelLoadError

    try:
        path = str(random_model_dir(spec)) if is_random(spec) else spec  # bench's random shapes, built once
        return {**gather_model(path, dtype, policy, quantization), "model": spec}
    except (ModelLoadError, RandomModelError) as exc:
        raise CliError(first_line(exc)) from None


def _print_model(model: dict, out: TextIO) -> None:
    from cbrun.process_memory import format_bytes

    params, held = model["parameter_bytes"], model["weight_bytes_held"]
    print(
        f"model      {model['model']} ({model['dtype']}): {format_bytes(params)} of parameters, "
        f"{format_bytes(held)} held for them ({held / params:.2f}x)",
        file=out,
    )
    print(
        f"{'':<11}loaded in {model['load_seconds']:.1f} s, engine ready {model['engine_start_seconds']:.1f} s later; "
        f"peak RSS {format_bytes(model['peak_rss_bytes'])}; linear kernels {model['linear_kernels']}",
        file=out,
    )
