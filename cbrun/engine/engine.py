"""The public engine: a background thread stepping `EngineCore`, plus the request API.

Callers add requests from any thread; the loop thread drains them into the
scheduler, runs steps, and hands finished results to a `ResultStore` and
per-token chunks to streams. One lock guards the core: a cancel therefore
takes effect between steps, and the request's blocks are free when
`cancel_request` returns.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import secrets
import threading
from collections import deque
from collections.abc import Iterator, Sequence

from cbrun.engine.config import ConfigError, EngineConfig
from cbrun.engine.core import EngineCore, StepOutcome
from cbrun.engine.model_spec import CausalLM, Tokenizer
from cbrun.engine.request import GenerationOutput, Request, RequestStatus, ScoreSpec, StreamChunk
from cbrun.engine.results import ResultStore
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.stats import StatsSnapshot
from cbrun.engine.weights import StashTarget, WeightSource, read_weights

log = logging.getLogger("cbrun.engine")

Prompt = str | Sequence[int]


class Engine:
    """Continuous-batching generation over a stock transformers causal LM."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.core = EngineCore(model, tokenizer, self.config)
        self.max_context = self.core.spec.max_context
        self.vocab_size = self.core.spec.vocab_size
        self._lock = threading.Lock()  # guards the core; held for a whole step
        self._inbox_cond = threading.Condition()  # guards the inbox and the closing flags only
        self._inbox: deque[Request] = deque()
        self._results = ResultStore()
        self._streams: dict[str, tuple[queue.Queue[StreamChunk], int]] = {}  # id -> (chunks, samples)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._draining = False
        self._closed = False
        self._asleep = False  # sleep() gave the KV pool back; requests are refused until wake_up()
        self._thread = threading.Thread(target=self._loop, name="cbrun-engine", daemon=True)
        self.core.backend.before_loop_thread()  # e.g. the loop thread's OpenMP pool must be the only one
        self._thread.start()

    # -- submitting ---------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | dict | None = None,
        request_id: str | None = None,
        *,
        stream: bool = False,
    ) -> str:
        """Queue one prompt (text or token ids); returns its id. Never raises for a bad request:
        it finishes with finish_reason "error" and a message instead."""
        return self._submit([(prompt, sampling, request_id)], stream)[0]

    def add_requests(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Queue many prompts, submitted in token-id order so shared prefixes hit the cache.

        `sampling` is one value for all prompts or a sequence with one per prompt.
        """
        ids: list[str | None] = list(request_ids) if request_ids is not None else [None] * len(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(ids) != len(prompts) or len(params) != len(prompts):
            raise ValueError("request_ids and per-prompt sampling must have one entry per prompt")
        return self._submit(list(zip(prompts, params, ids)), stream=False, sort=True)

    def _submit(
        self, entries: Sequence[tuple[Prompt, object, str | None]], stream: bool, sort: bool = False
    ) -> list[str]:
        prepared = [self._prepare(prompt, sampling, rid, stream) for prompt, sampling, rid in entries]
        order = sorted(range(len(prepared)), key=lambda i: prepared[i][1]) if sort else range(len(prepared))
        with self._inbox_cond:  # never waits for a running step
            if self._closed or self._draining:
                raise RuntimeError("engine is stopped; no new requests are accepted")
            self._refuse_while_asleep()
            for index in order:
                self._enqueue(*prepared[index])
            self._inbox_cond.notify()
        return [p[0] for p in prepared]

    def _prepare(
        self, prompt: Prompt, sampling: object, request_id: str | None, stream: bool
    ) -> tuple[str, list[int], SamplingParams, str | None, bool]:
        """Tokenize and validate outside the lock; returns (id, token ids, params, error)."""
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        error: str | None = None
        params = SamplingParams()
        try:
            params = _as_params(sampling)
        except (ConfigError, TypeError) as exc:
            error = f"invalid sampling parameters: {exc}"
        ids = self._tokenize(prompt)
        if isinstance(ids, str):
            error, ids = error or ids, []
        if error is None:
            error = self.core.validate(ids, params.max_tokens) or self.core.check_structured(params.structured)
        if stream:
            self._streams.setdefault(rid, (queue.Queue(), params.n))
        return rid, ids, params, error, stream

    def _tokenize(self, prompt: Prompt) -> list[int] | str:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return "text prompt given but the engine has no tokenizer"
            return list(self.tokenizer.encode(prompt))
        try:
            return [int(t) if not isinstance(t, bool) and float(t) == int(t) else t for t in prompt]
        except (TypeError, ValueError):
            return "prompt must be text or a list of token ids"

    def _enqueue(self, rid: str, ids: list[int], params: SamplingParams, error: str | None, stream: bool) -> None:
        if error is None and self._results.is_active(rid):
            error = f"duplicate request id {rid!r}: a request with this id is still running"
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._results.expect(rid, params.n, stream)
        for sample_index in range(params.n):
            request = Request(rid, sample_index, ids, params, seed, next(self._arrivals), stream=stream)
            if error is not None:
                self.core.finish(request, RequestStatus.FAILED, "error", error)
                self._deliver_finished(request)
            else:
                self._inbox.append(request)

    # -- scoring ------------------------------------------------------------
    def add_score_request(
        self,
        prompt: Prompt,
        completions: Sequence[Sequence[int]],
        request_id: str | None = None,
        *,
        samples: Sequence[int] | None = None,
        prompt_logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> str:
        """Queue teacher-forced scoring of token-id completions after one prompt; returns the id.

        Each completion is a result of its own (sample `samples[i]`, default i),
        with the logprob of every completion token at temperature 1, computed
        as `generate` computes the logprobs of the tokens it samples. The prompt
        is computed once for all completions when prefix caching is on.
        Never raises for a bad completion: its result carries the error.
        """
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        self._submit_score([self._prepare_score(prompt, completions, rid, samples, prompt_logprobs, top_logprobs)])
        return rid

    def score_batch(
        self,
        prompts: Sequence[Prompt],
        completions: Sequence[Sequence[Sequence[int]]],
        *,
        prompt_logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> list[GenerationOutput]:
        """Blocking: score completions[i] (a list of token-id lists) after prompts[i]; results in
        input order, the completions of one prompt adjacent. All requests arrive in one step's
        inbox, prefix-sorted, as `add_requests` submits them."""
        if len(prompts) != len(completions):
            raise ValueError("completions must have one list per prompt")
        ids = [f"score-{next(self._ids)}" for _ in prompts]
        groups = [
            self._prepare_score(prompt, group, rid, None, prompt_logprobs, top_logprobs)
            for rid, prompt, group in zip(ids, prompts, completions)
        ]
        self._submit_score(sorted(groups, key=lambda group: group[0].all_token_ids if group else []))
        outputs = []
        for rid, group in zip(ids, completions):
            samples = [self._results.get(rid, timeout=None) for _ in group]
            outputs.extend(sorted(samples, key=lambda o: o.sample_index))
        return outputs

    def _prepare_score(
        self,
        prompt: Prompt,
        completions: Sequence[Prompt],  # text is refused here, with a message
        rid: str,
        samples: Sequence[int] | None,
        prompt_logprobs: bool,
        top_logprobs: int,
    ) -> list[Request]:
        """Tokenize and validate outside the lock: one scoring Request per completion."""
        samples = list(samples) if samples is not None else list(range(len(completions)))
        if len(samples) != len(completions) or len(set(samples)) != len(samples):
            raise ValueError("samples must give one distinct index per completion")
        if not _is_int(top_logprobs) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer >= 0, got {top_logprobs!r}")
        tokenized = self._tokenize(prompt)
        prompt_error = tokenized if isinstance(tokenized, str) else None
        ids: list[int] = [] if isinstance(tokenized, str) else tokenized  # an error is never empty text
        params = SamplingParams(max_tokens=1, top_logprobs=top_logprobs)
        prepared = []
        for sample, completion in zip(samples, completions):
            tokens = self._tokenize(completion) if not isinstance(completion, str) else "completion must be token ids"
            error = prompt_error or (tokens if isinstance(tokens, str) else self.core.validate_score(ids, tokens))
            # without an error the tokens are ids (the isinstance only tells the type checker)
            spec = ScoreSpec(
                tuple(tokens) if error is None and not isinstance(tokens, str) else (), prompt_logprobs, top_logprobs
            )
            prepared.append(Request(rid, sample, ids, params, 0, 0, score=spec, error=error))
        return prepared

    def _submit_score(self, groups: list[list[Request]]) -> None:
        """Hand prepared scoring requests (a list per request id) to the loop in one go."""
        with self._inbox_cond:
            if self._closed or self._draining:
                raise RuntimeError("engine is stopped; no new requests are accepted")
            self._refuse_while_asleep()
            for group in groups:
                if group and self._results.is_active(group[0].request_id):
                    message = f"duplicate request id {group[0].request_id!r}: a request with this id is still running"
                    for request in group:
                        request.error = message
                if group:
                    self._results.expect(group[0].request_id, len(group), False)
                for request in group:
                    request.arrival_order = next(self._arrivals)
                    if request.error is not None:
                        self.core.finish(request, RequestStatus.FAILED, "error", request.error)
                        self._deliver_finished(request)
                    else:
                        self._inbox.append(request)
            self._inbox_cond.notify()

    # -- the loop -----------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                with self._inbox_cond:  # moved under the core lock: a hard stop sees every request
                    arrived = list(self._inbox)
                    self._inbox.clear()
                    closing = self._closed or self._draining
                for request in arrived:
                    self.core.add(request)
                if self.core.has_work():
                    self._step_safely()
                    continue
            with self._inbox_cond:
                if self._inbox:
                    continue
                if closing:
                    return
                self._inbox_cond.wait(timeout=0.5)

    def _step_safely(self) -> None:
        """One step; an unexpected error fails the live requests instead of killing the loop."""
        try:
            self._publish(self.core.step())
        except Exception as exc:
            log.exception("engine step failed")
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            for request in self.core.live_requests():
                try:
                    self.core.remove(request, RequestStatus.FAILED, "error", message)
                except Exception:  # bookkeeping may be what broke; `remove` finishes the request first: deliver it
                    log.exception("could not give back the blocks of a failed request")
                self._deliver_finished(request)

    def _publish(self, outcome: StepOutcome) -> None:
        for event in outcome.tokens:
            chunk = StreamChunk(
                event.request.request_id, event.request.sample_index, event.token_id, event.logprob, event.text
            )
            self._streams[event.request.request_id][0].put(chunk)
        for request in outcome.finished:
            self._deliver_finished(request)

    def _deliver_finished(self, request: Request) -> None:
        output = request.to_output()
        if request.stream:
            sent = request.stream_text
            tail = output.text[len(sent) :] if output.text.startswith(sent) else ""
            self._streams[request.request_id][0].put(
                StreamChunk(
                    request.request_id,
                    request.sample_index,
                    None,
                    None,
                    tail,
                    finish_reason=output.finish_reason,
                    error=output.error,
                )
            )
        self._results.put(output)

    # -- results --------------------------------------------------------------
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished result (of `request_id`, or of any request), or None on timeout."""
        return self._results.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Finished results as they come, until every submitted request has been returned."""
        while self._results.num_unreturned():
            output = self._results.get(None, timeout=None)
            if output is not None:
                yield output

    def stream(self, request_id: str) -> Iterator[StreamChunk]:
        """Per-token chunks of a request added with stream=True, in order; the last has finish_reason."""
        entry = self._streams.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id!r} was not added with stream=True")
        chunks, remaining = entry
        while remaining:
            chunk = chunks.get()
            if chunk.finish_reason is not None:
                remaining -= 1
            yield chunk
        self._streams.pop(request_id, None)

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | dict | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[GenerationOutput]:
        """Blocking: results in input order, samples of one prompt adjacent (len = prompts x n)."""
        ids = request_ids or [f"batch-{next(self._ids)}" for _ in prompts]
        self.add_requests(prompts, sampling, ids)
        outputs = []
        for rid in ids:
            samples = [self._results.get(rid, timeout=None) for _ in range(self._results.expected_samples(rid))]
            outputs.extend(sorted(samples, key=lambda o: o.sample_index))
        return outputs

    def cancel_request(self, request_id: str) -> bool:
        """Cancel every sample of a request; its blocks are free when this returns."""
        with self._lock, self._inbox_cond:
            found = [r for r in list(self._inbox) if r.request_id == request_id]
            for request in found:
                self._inbox.remove(request)
            live = [r for r in self.core.live_requests() if r.request_id == request_id]
            for request in found + live:
                if request in live:
                    self.core.remove(request, RequestStatus.CANCELLED, "cancelled")
                else:
                    self.core.finish(request, RequestStatus.CANCELLED, "cancelled")
                self._deliver_finished(request)
            return bool(found or live)

    def num_unfinished(self) -> int:
        """Submitted results not yet returned by get_result or iteration."""
        return self._results.num_unreturned()

    def stats(self) -> StatsSnapshot:
        with self._lock:
            return self.core.stats()

    def linear_kernels(self) -> str:
        """The linear method serving each weight dtype and whether its bits are the same on every CPU
        (the CPU backend's choice at load), or the backend's name where it has no such choice."""
        return self.core.backend.linear_kernels()

    # -- weights and memory between rollouts -----------------------------------
    def update_weights(self, weights: WeightSource) -> int:
        """Load new weights into the running engine; returns how many tensors were written.

        `weights`: a state dict (names of `model.state_dict()`, any dtype), (name, tensor)
        pairs, a safetensors file or a checkpoint directory. The prefix cache is dropped,
        so every later result is what a fresh engine with these weights gives, bit for bit.
        Only between batches: raises RuntimeError while requests are queued or running.
        """
        tensors = read_weights(weights)  # disk reads outside the lock
        with self._idle("update weights"):
            return self.core.update_weights(tensors)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold cache blocks."""
        with self._lock:
            return self.core.reset_prefix_cache()

    def sleep(self, level: int = 1, weights_to: StashTarget = None) -> None:
        """Give the KV cache memory back to the OS until `wake_up()`; level 2 frees the weights too.

        Level 2 parks the weights in `weights_to`: a safetensors file path, a directory, or a
        dict that receives the tensors (no copy); None writes a private temp file. Requests
        added while asleep raise RuntimeError.
        """
        with self._idle("sleep"):
            if self._asleep:
                raise RuntimeError("engine is already asleep")
            self.core.sleep(level, weights_to)
            self._asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep`: the weights as they were, an empty KV pool of the same size.

        tags (as vLLM's): None for both, or a subset of ("weights", "kv_cache").
        """
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        with self._lock, self._inbox_cond:
            self.core.wake_up(weights=tags is None or "weights" in tags, kv_cache=tags is None or "kv_cache" in tags)
            self._asleep = self.core.sleeping

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    @contextlib.contextmanager
    def _idle(self, action: str) -> Iterator[None]:
        """Hold the core with no request queued, running or offloaded (else RuntimeError)."""
        with self._lock, self._inbox_cond:
            if self._closed:
                raise RuntimeError(f"cannot {action}: the engine is destroyed")
            if self._inbox or self.core.has_work():
                raise RuntimeError(f"cannot {action} while requests are queued or running; wait for them first")
            yield

    def _refuse_while_asleep(self) -> None:
        if self._asleep:
            raise RuntimeError("engine is asleep (sleep() gave its memory back); call wake_up() before adding requests")

    # -- shutdown -------------------------------------------------------------
    def stop(self, hard: bool = False, timeout: float | None = None) -> None:
        """Drain (finish queued and active requests), or with hard=True fail them now."""
        with self._inbox_cond:
            self._draining = True
            self._inbox_cond.notify()
        if hard:
            with self._lock, self._inbox_cond:
                self._fail_all("engine stopped before the request finished")
        self._thread.join(timeout)

    def _fail_all(self, message: str) -> None:
        pending = list(self._inbox) + self.core.live_requests()
        self._inbox.clear()
        for request in pending:
            if request in self.core.live_requests():
                self.core.remove(request, RequestStatus.FAILED, "error", message)
            else:
                self.core.finish(request, RequestStatus.FAILED, "error", message)
            self._deliver_finished(request)

    def destroy(self) -> None:
        """Stop now and release the cache memory."""
        if self._thread.is_alive():
            self.stop(hard=True)
        with self._lock, self._inbox_cond:
            self._closed = True
            self.core.store.data = None
            self.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(hard=exc[0] is not None)
        self.destroy()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_params(sampling: object) -> SamplingParams:
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, dict):
        return SamplingParams(**sampling)
    raise TypeError(f"sampling must be SamplingParams or dict, got {type(sampling).__name__}")
