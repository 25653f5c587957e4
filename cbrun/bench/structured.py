"""Structured-output workloads in the benchmark: what each engine is asked, and whether it obeyed.

A workload's `structured` holds one StructuredSpec (or None) per prompt, from
the dataset rows (`json_schema`, `regex`, `choice`, `grammar`, `json_object`).
Each engine's outputs are checked independently of the engine: JSON rows must
parse and validate against their schema (`jsonschema`), regex rows must
fullmatch, choice rows must be one of the choices. Rows cut by max_tokens
before their grammar completed count as incomplete, not as valid.
`cbrun-free` runs the same prompts with the constraints dropped: the
unconstrained baseline of the same run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from cbrun.engine.sampling_params import StructuredSpec


@dataclass
class Validity:
    rows: int = 0
    valid: int = 0
    incomplete: int = 0  # finish_reason "length" before the constraint completed
    invalid: int = 0  # finished yet not valid (should be 0)
    first_invalid: str | None = None

    def add(self, spec: StructuredSpec, text: str, finish_reason: str) -> None:
        self.rows += 1
        if finish_reason == "length" and not is_valid(spec, text):
            self.incomplete += 1
        elif is_valid(spec, text):
            self.valid += 1
        else:
            self.invalid += 1
            self.first_invalid = self.first_invalid or f"{spec.kind}: {text[:80]!r}"

    def note(self) -> str:
        done = self.rows - self.incomplete
        share = 100.0 * self.valid / done if done else 0.0
        text = (
            f"structured: {self.valid}/{done} completed rows valid ({share:.1f}%), {self.incomplete} cut by max_tokens"
        )
        return text + (f"; first invalid: {self.first_invalid}" if self.first_invalid else "")

    def as_dict(self) -> dict:
        return {"rows": self.rows, "valid": self.valid, "incomplete": self.incomplete, "invalid": self.invalid}


def is_valid(spec: StructuredSpec, text: str) -> bool:
    """Whether `text` satisfies `spec`, checked without the engine's grammar library."""
    if spec.kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if spec.kind == "json_object":
            return isinstance(value, dict)
        import jsonschema

        try:
            jsonschema.validate(value, json.loads(spec.value))
        except jsonschema.ValidationError:
            return False
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if spec.kind == "choice":
        return text in spec.value
    return True  # grammars: no independent checker; the engine's own completion flag is all there is


def vllm_constraint(spec: StructuredSpec | None) -> dict | None:
    """The spec as keyword arguments of vLLM's StructuredOutputsParams (JSON-friendly)."""
    if spec is None:
        return None
    if spec.kind == "json_schema":
        return {"json": json.loads(spec.value)}
    if spec.kind == "json_object":
        return {"json_object": True}
    if spec.kind == "choice":
        return {"choice": list(spec.value)}
    return {spec.kind: spec.value}
