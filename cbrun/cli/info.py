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
from typing import Annotated

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

    from cbrun.engine.backends.cpu.kernels import cpu_flags, cpu_model, load_cpu_kernels

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
        from cbrun.engine.backends.cpu.method_selector import bf16_dot_products_here, choose_linear_method
        from cbrun.engine.backends.cpu.self_check import Shape, cache_path

        info["kernels"] = {
            "built": True,
            "build": kernels.build_name,
            "linear_vector_lanes": kernels.vector_width,
            "bf16_attention_scores": kernels.attend_dp_variant,  # vdpbf16ps's arithmetic: isa, twin or scalar
            "self_check_cache": str(cache_path()),
            "policy": policy,
        }
        shapes = [Shape(n, k) for n, k in _DEFAULT_MODEL_SHAPES]
        for dtype in (torch.float32, torch.bfloat16):
            choice = choose_linear_method(kernels, dtype, shapes, policy)
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


def info(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
    kernels: Annotated[str, typer.Option(help="The kernel policy to show: portable or fastest.")] = "portable",
) -> int:
    """Show the CPU, the kernel build, each dtype's linear method and its self-check, and versions."""
    from cbrun.cli.common import CliError

    if kernels not in ("portable", "fastest"):
        raise CliError(f"--kernels must be portable or fastest, got {kernels!r}")
    data = gather(kernels)
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
    scores = {"isa": "vdpbf16ps", "twin": "its portable twin", "scalar": "its plain-C reference"}
    print(
        f"{'':<11}bf16 attention scores: {scores[built['bf16_attention_scores']]} (checked at load; same bits)",
        file=out,
    )
    for dtype, method in data["linear_methods"].items():
        name = method["method"] or "none passed"
        bits = "same bits on every CPU" if method["same_bits_on_every_cpu"] else "this CPU's own bits"
        print(f"{dtype:<10} {name} ({bits})", file=out)
        for check in method["checks"]:
            cost = "cached" if check["cached"] else f"{check['seconds']:.2f} s"
            print(
                f"{'':<12}{'pass' if check['passed'] else 'FAIL'} {check['method']}: {check['detail']} ({cost})",
                file=out,
            )
    auto = data["dtype_auto_cpu"]
    print(f"dtype auto {auto['dtype']} on CPU: {auto['why']}", file=out)
    print(f"cache      {built['self_check_cache']}", file=out)
    return 0
