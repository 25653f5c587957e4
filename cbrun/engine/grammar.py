"""Structured outputs: a grammar matcher per constrained request, a token mask per step.

Built on llguidance (Rust, CPU wheels): chosen over xgrammar because it needs
no ahead-of-time compile per schema (a JSON schema becomes a matcher in well
under a millisecond, and the token masks are computed lazily from a shared
token trie), it refuses unsupported JSON-schema keywords instead of silently
ignoring them (so a schema it cannot enforce is an error row, never an
unenforced one), and its mask computation runs in Rust with the GIL released,
on a worker thread, while the model runs.

Flow for one constrained request (one per sample when n > 1):

    add ──> GrammarCompiler.matcher(spec)   one template per distinct spec, deep-copied per request
         └> MaskFiller.submit([state])      mask for the first token, computed in the background
    step t: sampler waits for the mask, sets disallowed logits of that row to -inf
            (sample/token_masks.py), samples
            core appends the token ──> state.consume(token); complete ──> finish "stop"
            MaskFiller.submit(every constrained row that got a token)  ──> ready by step t+1

Masks depend only on the request's own matcher state, and masking touches
only its own logits row, so batch invariance holds.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from cbrun.engine.model_spec import Tokenizer
from cbrun.engine.sampling_params import StructuredSpec

if TYPE_CHECKING:  # llguidance is imported where it is used (its native library loads then)
    from llguidance import LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger("cbrun.engine")

# JSON on one line with ", " and ": " separators: no tokens spent on layout, and no model can
# loop in whitespace. A schema's own "x-guidance" options override these defaults.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that cannot be enforced (does not compile, unsupported keyword); the message says why."""


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar for a spec (raises GrammarError for a value it cannot read)."""
    import llguidance

    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(spec.value)))
        return llguidance.grammar_from("regex" if spec.kind == "regex" else "grammar", spec.value)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{spec.kind}: {exc}") from None


def one_line(message: str) -> str:
    """llguidance's multi-line diagnostics as one line: the source excerpts and carets dropped."""
    kept = [
        line.strip()
        for line in message.splitlines()
        if line.strip().strip("^").strip() and not re.match(r"\s*\d+ \|", line)
    ]
    return " ".join(kept)


class GrammarCompiler:
    """Compiles each distinct StructuredSpec once for one tokenizer and hands out matchers.

    The llguidance tokenizer (a token trie over the vocabulary) is built on the
    first constrained request. `vocab_size` is the width of the model's logits,
    which may exceed the tokenizer's (padding rows are never allowed).
    Thread-safe: the engine's callers check specs while its loop creates matchers.
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: LLTokenizer | None = None
        self._templates: dict[StructuredSpec, LLMatcher | str] = {}  # spec -> template LLMatcher or error message
        self._lock = threading.Lock()
        self.compiles = 0  # distinct specs compiled (a job with one schema compiles once)

    def check(self, spec: StructuredSpec) -> str | None:
        """Why `spec` cannot be enforced with this tokenizer, or None."""
        template = self._template(spec)
        return template if isinstance(template, str) else None

    def matcher(self, spec: StructuredSpec) -> LLMatcher:
        """A fresh matcher for `spec` (raises GrammarError when it cannot be enforced)."""
        template = self._template(spec)
        if isinstance(template, str):
            raise GrammarError(template)
        return template.deep_copy()

    def _template(self, spec: StructuredSpec) -> LLMatcher | str:
        with self._lock:
            found = self._templates.get(spec)
            if found is None:
                found = self._templates[spec] = self._compile(spec)
                self.compiles += 1
            return found

    def _compile(self, spec: StructuredSpec) -> LLMatcher | str:
        import llguidance

        if self._hf_tokenizer is None:
            return "structured outputs need the model's tokenizer; the engine has none"
        try:
            tokenizer = self._llg_tokenizer()
            grammar = grammar_text(spec)
        except GrammarError as exc:
            return str(exc)
        except Exception as exc:  # a tokenizer llguidance cannot read
            return f"{spec.kind}: the tokenizer cannot be used for structured outputs: {exc}"
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            return f"{spec.kind}: does not compile: {'; '.join(one_line(m) for m in messages)}"
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"{spec.kind}: does not compile: {one_line(matcher.get_error())}"
        return matcher

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            assert self._hf_tokenizer is not None  # `_compile` answers without a tokenizer before asking
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer


class GrammarState:
    """One request's matcher and the mask of tokens allowed next.

    `mask` is a packed bitmask [ceil(V / 32)] int32 (bit i of word w allows
    token 32 * w + i), valid for the matcher's current state; `pending` is the
    background computation that will fill it.
    """

    def __init__(self, spec: StructuredSpec, matcher: LLMatcher) -> None:
        self.spec = spec
        self.matcher = matcher
        self.mask: torch.Tensor | None = None
        self.pending: Future | None = None
        self.error: str | None = None

    def allowed_mask(self) -> torch.Tensor:
        """The packed mask for the next token, waiting for its computation if needed."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        assert self.mask is not None, "mask requested before MaskFiller.submit"
        return self.mask

    def consume(self, token: int) -> None:
        """Advance the matcher by a sampled token; the old mask is void from here on."""
        self.mask = None
        if not self.matcher.consume_token(token):
            self.error = f"the grammar rejected token {token}: {self.matcher.get_error().strip()}"

    @property
    def complete(self) -> bool:
        """The grammar is finished: nothing but the end may follow."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete match (it could end here)."""
        return self.matcher.is_accepting()


class MaskFiller:
    """Computes next-token masks on one worker thread (llguidance releases the GIL), so the
    masks for step t + 1 are built while step t + 1's forward runs."""

    def __init__(self, vocab_size: int) -> None:
        import llguidance

        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cbrun-grammar")

    def submit(self, states: list[GrammarState]) -> None:
        """Start computing the masks of these states' next tokens."""
        if not states:
            return
        future = self._pool.submit(self._fill, list(states))
        for state in states:
            state.pending = future

    def _fill(self, states: list[GrammarState]) -> None:
        import llguidance.torch

        masks = torch.empty(len(states), self.words, dtype=torch.int32)  # [n, W]
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(state.matcher, row) for row, state in enumerate(states)], masks
        )
        for row, state in enumerate(states):
            state.mask = masks[row]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
