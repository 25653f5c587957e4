"""Test doubles for the data layer: a byte tokenizer and an engine that needs no model.

FakeEngine follows the Engine API that `cbrun.data.job` uses (add_request,
get_result, stop, stats, max_context, vocab_size) and produces deterministic
completions, so job logic can be tested in milliseconds. Product code never
uses it.
"""

from __future__ import annotations

import random
import time

from cbrun.engine.request import GenerationOutput
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.stats import StatsSnapshot

OFFSET = 3  # ids 0..2 are special: 0 pad, 1 bos, 2 eos


class FakeTokenizer:
    """Bytes as tokens (id = byte + 3); BOS is added like a real tokenizer does."""

    chat_template = "fake"
    bos_token_id = 1
    vocab_size = 256 + OFFSET

    def __call__(self, texts, add_special_tokens: bool = True):
        single = isinstance(texts, str)
        encoded = [self.encode(t, add_special_tokens) for t in ([texts] if single else texts)]
        return {"input_ids": encoded[0] if single else encoded}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [b + OFFSET for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        for m in messages:
            if not isinstance(m["content"], str):
                raise TypeError("content must be a string")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __len__(self) -> int:
        return self.vocab_size


def fake_completion(prompt: list[int], seed: int, sample: int, max_tokens: int) -> list[int]:
    """Lowercase letters that depend on the prompt, the seed and the sample index only."""
    h = hash((tuple(prompt), seed, sample))
    return [ord("a") + OFFSET + (h >> (k % 48)) % 26 for k in range(max_tokens)]


class FakeEngine:
    """Finishes requests in a random order, one result per get_result call.

    fail: request ids the engine fails with an error.
    record_submitted: keep the submitted ids in `submitted` (off for memory measurements).
    max_in_flight: the most results submitted and not yet returned, seen so far.
    """

    def __init__(
        self, max_context: int = 512, fail: set[str] | None = None, seed: int = 0, record_submitted: bool = True
    ):
        self.tokenizer = FakeTokenizer()
        self.max_context = max_context
        self.vocab_size = FakeTokenizer.vocab_size
        self.fail = fail or set()
        self._ready: list[GenerationOutput] = []
        self._rng = random.Random(seed)
        self.submitted: list[str] = []
        self.record_submitted = record_submitted
        self.max_in_flight = 0
        self.stopped = False
        self.stats_calls = 0

    def add_request(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stream: bool = False,
        lora: str | None = None,
    ) -> str:
        """As Engine.add_request; the fake has no adapters, so a row naming one fails as the engine's would."""
        if self.stopped:
            raise RuntimeError("engine is stopped; no new requests are accepted")
        sampling = sampling or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if self.record_submitted:
            self.submitted.append(request_id)
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(32)
        error = "boom" if request_id in self.fail else None
        if len(ids) + sampling.max_tokens > self.max_context:
            error = "too long"
        if lora is not None:
            error = f"unknown LoRA adapter {lora!r} (loaded: none)"
        for sample in range(sampling.n):
            tokens = [] if error else fake_completion(ids, seed, sample, sampling.max_tokens)
            top = (
                [[(t, -0.5), (t + 1, -1.5)][: sampling.top_logprobs] for t in tokens] if sampling.top_logprobs else None
            )
            self._ready.append(
                GenerationOutput(
                    request_id=request_id,
                    sample_index=sample,
                    prompt_token_ids=ids,
                    token_ids=tokens,
                    text=self.tokenizer.decode(tokens),
                    logprobs=[-0.25] * len(tokens),
                    finish_reason="error" if error else "length",
                    error=error,
                    top_logprobs=top,
                    num_cached_tokens=0,
                )
            )
        self.max_in_flight = max(self.max_in_flight, len(self._ready))
        return request_id

    def get_result(self, request_id=None, timeout=None):
        """A random finished result: completion order differs from submission order."""
        if not self._ready:
            time.sleep(min(timeout or 0, 0.001))
            return None
        pick = self._rng.randrange(len(self._ready))
        self._ready[pick], self._ready[-1] = self._ready[-1], self._ready[pick]
        return self._ready.pop()

    def stop(self, hard: bool = False, timeout=None) -> None:
        self.stopped = True
        if hard:
            self._ready = [
                GenerationOutput(
                    request_id=o.request_id,
                    sample_index=o.sample_index,
                    prompt_token_ids=o.prompt_token_ids,
                    token_ids=[],
                    text="",
                    logprobs=[],
                    finish_reason="error",
                    error="engine stopped before the request finished",
                )
                for o in self._ready
            ]

    def stats(self) -> StatsSnapshot:
        self.stats_calls += 1
        return StatsSnapshot(
            steps=self.stats_calls,
            pending=len(self._ready),
            blocks_total=100,
            blocks_used=30,
            blocks_cached=10,
            blocks_free=60,
            prompt_tokens=1000,
            prefix_hit_tokens=250,
            computed_prompt_tokens=750,
            generated_tokens=500,
            elapsed_s=2.0,
        )
