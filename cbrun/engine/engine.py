"""The public engine: the request API in front of `EngineCore`, which a loop thread steps.

How a request travels:

    add_request / add_score_request (caller's thread)
      -> Processor (processor.py): tokenize, validate; a refused request carries its reason
      -> Engine._submit: the one submit path (ids, duplicates, results expected)
      -> CoreLoop (core_loop.py): the inbox, then the loop thread adds it to the core
      -> EngineCore.step (core.py), until it finishes
      -> Engine._deliver (the loop thread): the ResultStore and the request's stream

Only the loop thread touches the core. Cancels, aborts, pauses, statistics,
weight updates and sleep are calls it runs between steps, so the core needs no
lock.

Around a weight update (vLLM's pause_generation): pause in mode "abort" (live
requests end now with what they have, finish_reason "abort"), "wait" (they
finish on the old weights first) or "keep" (they stay; after the update they
are computed again under the new weights and go on from where they stopped),
update, resume. Every token records the weights' version it was sampled under.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar, overload

from cbrun.engine.config import EngineConfig
from cbrun.engine.core import EngineCore, TokenEvent
from cbrun.engine.core_loop import CoreLoop
from cbrun.engine.lora_control import LoRAControl
from cbrun.engine.model_spec import CausalLM, Tokenizer
from cbrun.engine.processor import Processor, Prompt, submission_order
from cbrun.engine.request import GenerationOutput, Request, RequestStatus, StreamChunk
from cbrun.engine.results import ResultStore
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.stats import StatsSnapshot
from cbrun.engine.streams import Streams
from cbrun.engine.weights import StashTarget, WeightSource, read_weights

T = TypeVar("T")

__all__ = ["Engine", "Prompt"]


class Engine:
    """Continuous-batching generation over a stock transformers causal LM."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.core = EngineCore(model, tokenizer, self.config)
        self.max_context = self.core.spec.max_context
        self.vocab_size = self.core.spec.vocab_size
        self.processor = Processor.serving(self.core, tokenizer)
        self._results = ResultStore()
        self._streams = Streams()
        self._ids = itertools.count()
        self._asleep = False  # sleep() gave the KV pool back; requests are refused until wake_up()
        self._loop = CoreLoop(self.core, self._deliver, self._stream_token)
        self._loop.start()
        self.loras = LoRAControl(self.core, self._loop, self._while_idle)  # LoRA adapters: add, update, remove
        self.loras.add_at_start(self.config.lora_modules, self.destroy)

    # -- submitting ---------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | dict | None = None,
        request_id: str | None = None,
        *,
        stream: bool = False,
        on_chunk: Callable[[StreamChunk], None] | None = None,
        lora: str | None = None,
    ) -> str:
        """Queue one prompt (text or token ids); returns its id. Never raises for a bad request:
        it finishes with finish_reason "error" and a message instead.

        stream: read its tokens with `stream(id)`. on_chunk: instead, each chunk is handed to it on the
        engine's thread (it must not block; AsyncLLM passes them to its event loop). The last chunk of each
        sample carries its whole result (`StreamChunk.output`). lora: run it with this loaded adapter (add_lora)."""
        rid = self._new_id(request_id)
        streamed = stream or on_chunk is not None
        group = self.processor.process(prompt, sampling, rid, streamed, lora)
        if streamed:
            self._streams.open(rid, len(group), on_chunk)
        self._submit([group], streamed)
        return rid

    def add_requests(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        request_ids: Sequence[str] | None = None,
        loras: str | Sequence[str | None] | None = None,
    ) -> list[str]:
        """Queue many prompts, submitted in token-id order so shared prefixes hit the cache.

        `sampling` is one value for all prompts or a sequence with one per prompt; `loras` likewise (adapter
        names, None for the base model).
        """
        groups = self.processor.process_many(prompts, sampling, request_ids, loras, self._new_id)
        self._submit(sorted(groups, key=submission_order), stream=False)
        return [group[0].request_id for group in groups]

    def add_score_request(
        self,
        prompt: Prompt,
        completions: Sequence[Sequence[int]],
        request_id: str | None = None,
        *,
        samples: Sequence[int] | None = None,
        prompt_logprobs: bool = False,
        top_logprobs: int = 0,
        lora: str | None = None,
    ) -> str:
        """Queue teacher-forced scoring of token-id completions after one prompt; returns the id.

        Each completion is a result of its own (sample `samples[i]`, default i),
        with the logprob of every completion token at temperature 1, computed
        as `generate` computes the logprobs of the tokens it samples. The prompt
        is computed once for all completions when prefix caching is on.
        Never raises for a bad completion: its result carries the error.
        """
        rid = self._new_id(request_id)
        group = self.processor.process_score(prompt, completions, rid, samples, prompt_logprobs, top_logprobs, lora)
        self._submit([group])
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
            self.processor.process_score(prompt, group, rid, None, prompt_logprobs, top_logprobs)
            for rid, prompt, group in zip(ids, prompts, completions)
        ]
        self._submit(sorted(groups, key=submission_order))
        outputs = []
        for rid, group in zip(ids, completions):
            samples = [self._results.get(rid, timeout=None) for _ in group]
            outputs.extend(sorted(samples, key=lambda o: o.sample_index))
        return outputs

    def _new_id(self, request_id: str | None) -> str:
        return str(request_id) if request_id is not None else f"req-{next(self._ids)}"

    def _submit(self, groups: Sequence[list[Request]], stream: bool = False) -> None:
        """The one way requests reach the core: each group is one request id's Requests (its samples or
        completions), handed to the loop in order with the id's results expected. A newcomer whose id is
        still running is refused (keeping an earlier reason if it has one)."""

        def admit() -> list[Request]:
            if self._asleep:
                raise RuntimeError(
                    "engine is asleep (sleep() gave its memory back); call wake_up() before adding requests"
                )
            for group in groups:
                if not group:
                    continue
                rid = group[0].request_id
                if self._results.is_active(rid):
                    for request in group:
                        request.error = (
                            request.error or f"duplicate request id {rid!r}: a request with this id is still running"
                        )
                self._results.expect(rid, len(group), stream)
            return [request for group in groups for request in group]

        self._loop.submit(admit)

    # -- what the loop hands back (on its thread) ---------------------------------
    def _stream_token(self, event: TokenEvent) -> None:
        request = event.request
        version = request.weight_versions[-1]
        chunk = StreamChunk(request.request_id, request.sample_index, event.token_id, event.logprob, event.text)
        chunk.weight_version = version
        chunk.top_logprobs = request.top_logprobs[-1] if request.top_logprobs else None
        self._streams.put(chunk)

    def _deliver(self, request: Request) -> None:
        """A finished request's result: the last chunk of its stream, or into the result store."""
        output = request.to_output()
        if request.stream:
            sent = request.stream_text
            tail = output.text[len(sent) :] if output.text.startswith(sent) else ""
            chunk = StreamChunk(request.request_id, request.sample_index, None, None, tail, output.finish_reason)
            chunk.error, chunk.output = output.error, output
            self._streams.put(chunk)
        self._results.put(output)

    # -- results --------------------------------------------------------------
    @overload
    def get_result(self, request_id: str | None = None, *, timeout: None = None) -> GenerationOutput: ...

    @overload
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None: ...

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
        return self._streams.read(request_id)

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
        return bool(
            self._loop.call(
                lambda: self._loop.end_live(lambda r: r.request_id == request_id, RequestStatus.CANCELLED, "cancelled")
            )
        )

    def abort(self, request_ids: str | Iterable[str]) -> list[GenerationOutput]:
        """End these requests now (vLLM's abort_request) and return what each live sample produced so far:
        tokens, logprobs, text, weight versions, with finish_reason "abort". Ids not live are skipped.

        The results are also delivered as any end is (get_result, streams): whoever waits on them gets
        them. Blocks are free when this returns. In the order of `request_ids`, samples in order."""
        ids = [request_ids] if isinstance(request_ids, str) else [str(i) for i in request_ids]
        wanted = set(ids)
        ended = self._loop.call(
            lambda: self._loop.end_live(lambda r: r.request_id in wanted, RequestStatus.CANCELLED, "abort")
        )
        ended.sort(key=lambda r: (ids.index(r.request_id), r.sample_index))
        return [request.to_output() for request in ended]

    def num_unfinished(self) -> int:
        """Submitted results not yet returned by get_result or iteration."""
        return self._results.num_unreturned()

    def stats(self) -> StatsSnapshot:
        """The core's counters, taken between steps."""
        return self._loop.call(self.core.stats)

    def linear_kernels(self) -> str:
        """The linear method serving each weight dtype and whether its bits are the same on every CPU
        (the CPU backend's choice at load), or the backend's name where it has no such choice."""
        return self.core.backend.linear_kernels()

    def weight_bytes(self) -> int:
        """Bytes held for the model's weights (each storage once: the CPU backend's packed matrices and what the
        model keeps), for the run summary and `cbrun info`."""
        return self.core.backend.weight_bytes(self.core.model)

    # -- pausing around a weight update (vLLM's pause_generation / resume_generation) --------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> list[GenerationOutput]:
        """Stop generating until `resume_generation`; returns the requests ended ("abort" mode).

        mode "abort": live requests end now with what they have (finish_reason "abort");
        "wait" (or "finish"): returns once they have finished on the current weights;
        "keep": they stay where they are, and go on at resume (recomputed under new weights
        if an update came in between). Requests submitted while paused wait for the resume.
        clear_cache: forget cached prefixes once nothing holds them (kept requests hold theirs).
        """
        mode = "wait" if mode == "finish" else mode
        ended = self._loop.call(lambda: self._loop.pause(mode))
        self._loop.wait_drained()
        if clear_cache:
            self._loop.call(self.core.reset_prefix_cache)
        return [request.to_output() for request in ended]

    def resume_generation(self) -> None:
        """Step again after `pause_generation` (nothing happens if not paused)."""
        if self._asleep and self._loop.call(self.core.has_work):
            raise RuntimeError("engine is asleep with requests a pause kept; call wake_up() before resuming")
        self._loop.call(self._loop.resume)

    def is_paused(self) -> bool:
        return self._loop.pause_mode is not None

    @property
    def weight_version(self) -> int:
        """How many times update_weights has changed the weights (each token's version is recorded)."""
        return self.core.weight_version

    def update_weights(self, weights: WeightSource, pause_mode: str | None = None) -> int:
        """Load new weights into the running engine; returns how many tensors were written.

        `weights`: a state dict (names of `model.state_dict()`, any dtype), (name, tensor)
        pairs, a safetensors file or a checkpoint directory. The prefix cache is dropped,
        so every later result is what a fresh engine with these weights gives, bit for bit.
        Between batches or while paused; otherwise RuntimeError while requests are queued or
        running, unless `pause_mode` is given: then it pauses in that mode, updates and resumes.
        Requests a "keep" pause holds are recomputed under the new weights and go on.
        """
        tensors = read_weights(weights)  # disk reads in the caller's thread, while the loop steps
        return self._while_idle("update weights", lambda: self.core.update_weights(tensors), pause_mode)

    def _while_idle(self, action: str, change: Callable[[], T], pause_mode: str | None) -> T:
        """Run `change` on the loop between batches (RuntimeError while requests run), or, with `pause_mode`,
        pause in that mode, run it and resume."""
        if pause_mode is None:
            return self._loop.call_idle(action, change)
        self.pause_generation(pause_mode)
        try:
            return self._loop.call_idle(action, change)
        finally:
            self.resume_generation()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold cache blocks."""
        return self._loop.call(self.core.reset_prefix_cache)

    def sleep(self, level: int = 1, weights_to: StashTarget = None) -> None:
        """Give the KV cache memory back to the OS until `wake_up()`; level 2 frees the weights too.

        Level 2 parks the weights in `weights_to`: a safetensors file path, a directory, or a
        dict that receives the tensors (no copy); None writes a private temp file. Requests
        added while asleep raise RuntimeError. While paused, requests the pause kept lose their
        K/V with the pool and are computed again after wake_up and resume.
        """

        def sleep() -> None:
            if self._asleep:
                raise RuntimeError("engine is already asleep")
            self.core.sleep(level, weights_to)
            self._asleep = True  # before submissions may go on: call_idle holds them meanwhile

        self._loop.call_idle("sleep", sleep)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep`: the weights as they were, an empty KV pool of the same size.

        tags (as vLLM's): None for both, or a subset of ("weights", "kv_cache").
        """
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")

        def wake_up() -> None:
            self.core.wake_up(weights=tags is None or "weights" in tags, kv_cache=tags is None or "kv_cache" in tags)
            self._asleep = self.core.sleeping

        self._loop.call(wake_up)

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    # -- shutdown -------------------------------------------------------------
    def stop(self, hard: bool = False, timeout: float | None = None) -> None:
        """Drain (finish queued and active requests), or with hard=True fail them now."""
        self._loop.stop(hard, "engine stopped before the request finished", timeout)

    def destroy(self, give_back_weights: bool = True) -> None:
        """Stop now and release the cache memory. The model gets its own weights back, bit for bit (the CPU
        backend held them in its packed layout); a caller done with the model passes give_back_weights=False
        and the packed weights are freed instead (no second copy is made)."""
        if self._loop.running:
            self.stop(hard=True)

        def close() -> None:
            self._loop.closed = True
            self.core.store.data = None
            self.core.close(give_back_weights)

        self._loop.call(close)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(hard=exc[0] is not None)
        self.destroy()
