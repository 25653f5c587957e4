"""`AsyncLLM`: vLLM's asynchronous API over cbrun's engine, for RL frameworks that stream rollouts.

    engine = AsyncLLM("smollm2-135m", dtype="float32")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)            # cumulative, as vLLM's default output kind
    await engine.abort("r1")                  # from another task: the stream ends with finish_reason "abort"

The engine steps on its own thread; each token reaches the caller's event
loop through `call_soon_threadsafe`, so nothing here blocks the loop but the
short calls that wait for the engine between two steps (abort, pause, weights),
which run in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from cbrun.engine.request import StreamChunk
from cbrun.engine.weights import WeightSource
from cbrun.llm.inputs import encode_prompts
from cbrun.llm.llm import LLM
from cbrun.llm.outputs import CompletionOutput, RequestOutput
from cbrun.llm.params import SamplingParams, UnsupportedFieldError


class AsyncLLM:
    """An in-process engine with vLLM's AsyncLLM interface; takes the same arguments as `LLM`."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.llm = LLM(model, **kwargs)
        self._running: set[str] = set()

    @classmethod
    def from_llm(cls, llm: LLM) -> AsyncLLM:
        """An AsyncLLM over an LLM already made (both may be used, from different threads)."""
        engine = cls.__new__(cls)
        engine.llm, engine._running = llm, set()
        return engine

    async def generate(
        self,
        prompt: str | dict,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: Any = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's RequestOutput after each new token (cumulative: all tokens so far, every
        sample that has begun), the last one with `finished` True. An abort ends it with finish_reason
        "abort"; closing or cancelling the generator aborts the request, as vLLM's does."""
        if priority != 0:
            raise UnsupportedFieldError("AsyncLLM.generate: priority is not supported by cbrun")
        if not isinstance(prompt, (str, dict)):
            raise TypeError("prompt must be a string or a prompt dict ({'prompt': ...} or {'prompt_token_ids': ...})")
        params = sampling_params
        if params.prompt_logprobs is not None:
            raise UnsupportedFieldError("AsyncLLM.generate: prompt_logprobs are not supported; use LLM.generate")
        if params.logprobs is not None and not params.greedy and params.temperature != 1.0:
            raise UnsupportedFieldError(
                "AsyncLLM.generate: logprobs are reported at temperature 0 or 1 only (vLLM's raw logprobs at "
                "another temperature need LLM.generate's rescoring pass)"
            )
        if request_id in self._running:
            raise ValueError(f"request id {request_id!r} is already running")
        [(text, ids)] = encode_prompts([prompt], self.llm.tokenizer)
        engine_params = self.llm.engine_params(0, ids, params)
        [adapter] = self.llm.adapters.per_prompt(lora_request, 1)  # loaded on first use (a file read)
        lora = adapter.lora_name if adapter is not None else None
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[StreamChunk] = asyncio.Queue()

        def sink(chunk: StreamChunk) -> None:  # the engine's thread
            with contextlib.suppress(RuntimeError):  # the caller's event loop has closed: nobody is reading
                loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        self._running.add(request_id)
        stream = _Cumulative(self.llm, request_id, text, ids, params)
        try:
            self.llm.engine.add_request(ids, engine_params, request_id, on_chunk=sink, lora=lora)
            while not stream.finished:
                stream.add(await chunks.get())
                yield stream.output()
        except (asyncio.CancelledError, GeneratorExit):
            if not stream.finished:
                await asyncio.to_thread(self.llm.engine.abort, [request_id])
            raise
        finally:
            self._running.discard(request_id)

    async def abort(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """End requests now; their generators yield a last output with finish_reason "abort" (also returned)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        return await asyncio.to_thread(self.llm.abort, ids)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause: "abort", "wait" (or "finish") or "keep" the requests in flight (see LLM)."""
        await asyncio.to_thread(self.llm.pause_generation, mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        await asyncio.to_thread(self.llm.resume_generation)

    async def is_paused(self) -> bool:
        return self.llm.is_paused()

    async def update_weights(self, weights: WeightSource, pause_mode: str | None = None) -> int:
        """LLM.update_weights in a worker thread (weights read from disk there too)."""
        return await asyncio.to_thread(self.llm.update_weights, weights, pause_mode)

    async def sleep(self, level: int = 1) -> None:
        await asyncio.to_thread(self.llm.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await asyncio.to_thread(self.llm.wake_up, tags)

    async def is_sleeping(self) -> bool:
        return self.llm.engine.is_sleeping

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.to_thread(self.llm.reset_prefix_cache)

    def get_tokenizer(self) -> Any:
        return self.llm.tokenizer

    def shutdown(self) -> None:
        self.llm.close()


class _Cumulative:
    """A streamed request's samples as chunks arrive: tokens so far, then each sample's final result."""

    def __init__(self, llm: LLM, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams) -> None:
        self.llm, self.request_id, self.prompt, self.ids, self.params = llm, request_id, prompt, ids, params
        self.samples: dict[int, CompletionOutput] = {}
        self.done: set[int] = set()

    @property
    def finished(self) -> bool:
        return len(self.done) == self.params.n

    def add(self, chunk: StreamChunk) -> None:
        if chunk.output is not None:  # a sample's last chunk: its whole result, built as LLM.generate builds it
            if chunk.output.error is not None:
                raise ValueError(f"request {self.request_id!r}: {chunk.output.error}")
            self.samples[chunk.sample_index] = self.llm.output_builder.completion(chunk.output, self.params)
            self.done.add(chunk.sample_index)
            return
        assert chunk.token_id is not None and chunk.logprob is not None and chunk.weight_version is not None
        so_far = self.samples.setdefault(chunk.sample_index, _empty(chunk.sample_index, self.params))
        so_far.token_ids.append(chunk.token_id)
        so_far.text += chunk.text if self.params.detokenize else ""
        so_far.weight_versions.append(chunk.weight_version)
        so_far.weight_version = chunk.weight_version
        if so_far.logprobs is not None:
            argmax = self.params.greedy and self.params.constraint is None
            position = self.llm.output_builder.position(chunk.token_id, chunk.logprob, chunk.top_logprobs or [], argmax)
            so_far.logprobs.append(position)
            so_far.cumulative_logprob = (so_far.cumulative_logprob or 0.0) + chunk.logprob

    def output(self) -> RequestOutput:
        outputs = [self.samples[index] for index in sorted(self.samples)]
        copies = [
            CompletionOutput(
                o.index,
                o.text,
                list(o.token_ids),
                o.cumulative_logprob,
                None if o.logprobs is None else list(o.logprobs),
                o.finish_reason,
                o.stop_reason,
                weight_version=o.weight_version,
                weight_versions=list(o.weight_versions),
            )
            for o in outputs
        ]
        return RequestOutput(self.request_id, self.prompt, list(self.ids), None, copies, finished=self.finished)


def _empty(index: int, params: SamplingParams) -> CompletionOutput:
    with_logprobs = params.logprobs is not None
    return CompletionOutput(index, "", [], 0.0 if with_logprobs else None, [] if with_logprobs else None)
