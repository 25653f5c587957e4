"""The synchronous engine core: one `step()` is schedule -> build -> forward -> sample -> update.

No threads and no locks here: one thread, the engine's loop (core_loop.py),
calls every method, and the request API (engine.py) owns queues, results and
streams. Requests arrive validated (processor.py). Keeping the core
synchronous makes it easy to test and to reason about: read `step()` and you
know the engine.

A request's life ends in one place, `finish`: its status, reason, error,
finish time and final text, and the stats counter of how it ended. Every end
goes through it: stop and length, a grammar's error, a request the scheduler
found too large, a failed forward, and the engine's cancels, hard stops,
failed steps and requests the processor refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from cbrun.engine.backends.base import Backend
from cbrun.engine.backends.selector import choose_backend
from cbrun.engine.cache.kv_cache import KVCacheManager
from cbrun.engine.cache.kv_store import KVStore
from cbrun.engine.cache.offload import make_preemptor
from cbrun.engine.cache.sizing import choose_num_blocks
from cbrun.engine.config import EngineConfig
from cbrun.engine.detokenize import Detokenizer
from cbrun.engine.grammar import GrammarCompiler, GrammarState, MaskFiller
from cbrun.engine.host_memory import give_back_memory
from cbrun.engine.model_spec import CausalLM, ModelSpec, Tokenizer, default_device, read_model_spec
from cbrun.engine.request import Request, RequestStatus
from cbrun.engine.sample.scoring import ScoredRows
from cbrun.engine.scheduler import Scheduler
from cbrun.engine.stats import StatsSnapshot, snapshot
from cbrun.engine.step.attention import register as register_attention
from cbrun.engine.step.batch import BatchBuilder, PagedBatch
from cbrun.engine.step.model_runner import ModelRunner, StepLogits
from cbrun.engine.stop_checks import check_stop
from cbrun.engine.weights import StashTarget, WeightStash
from cbrun.lora.adapters import LoRAAdapters

log = logging.getLogger("cbrun.engine")


@dataclass
class TokenEvent:
    """One token appended to a request this step (for streams)."""

    request: Request
    token_id: int
    logprob: float
    text: str


@dataclass
class StepOutcome:
    finished: list[Request] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)


class EngineCore:
    """Owns the model, the cache, the scheduler and every live request."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig) -> None:
        self.config = config
        self.spec: ModelSpec = read_model_spec(model, tokenizer)
        self.device = default_device(model)
        self._stock_attention = model.config._attn_implementation  # given back at close
        model.set_attn_implementation(register_attention())
        model.eval()
        self.model = model
        num_blocks = config.num_blocks or choose_num_blocks(self.spec, config, self.device, model.config.hidden_size)
        self.cache = KVCacheManager(
            num_blocks,
            config.page_size,
            sliding_window=self.spec.sliding_window,
            has_full_layers=self.spec.has_full_layers,
            allow_block_sharing=config.allow_block_sharing,
        )
        if config.allow_block_sharing and not self.cache.sharing:
            log.info("prefix caching is off: the model has sliding-window layers")
        self.store = KVStore(self.spec.kv, num_blocks, config.page_size, self.device)
        if config.prefault_blocks:
            prefault = min(config.prefault_blocks, num_blocks)
            self.store.prefault(prefault)
            self.cache.pool.touched = prefault
        self.preemptor = make_preemptor(self.cache, self.store, config.cpu_offload_space)
        self.scheduler = Scheduler(config, self.cache, self.preemptor)
        # kernels, linears, attention, sampler
        self.backend: Backend = choose_backend(model, config.backend, self.spec, config.kernels, config.quantization)
        self.builder = BatchBuilder(
            self.cache,
            self.store,
            self.spec.layer_groups,
            config.page_size,
            self.spec.sliding_window,
            self.device,
            self.backend.metadata_builder,
        )
        self.adapters = LoRAAdapters.serving(model, self.backend, config) if config.enable_lora else None
        self.builder.adapters = self.adapters
        self.runner = ModelRunner(model, self.backend, self.adapters)
        self.detok = Detokenizer(tokenizer)
        self.grammars = GrammarCompiler(tokenizer, self.spec.vocab_size)  # structured outputs, one compile per spec
        self._masks: MaskFiller | None = None  # started with the first constrained request
        self._stats = StatsSnapshot(blocks_total=num_blocks)
        self._started = time.perf_counter()
        self._stash: WeightStash | None = None  # the weights while asleep at level 2
        self.weight_version = 0  # one more at each update_weights; every token records the version it came from
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s)",
            num_blocks,
            config.page_size,
            self.store.nbytes / 2**30,
            self.spec.kv.dtype,
        )

    def close(self, give_back_weights: bool = True) -> None:
        """Give the model back as it came: its weights and its attention implementation (so that the caller's own
        `model.generate` works again); without `give_back_weights` (a caller that discards the model) the weights
        the backend holds are only freed."""
        if self.adapters is not None:
            self.adapters.close()  # its hooks off the model first
        self.backend.close(restore=give_back_weights)
        if self._stash is not None and give_back_weights:  # closed asleep at level 2: the weights go back
            self._stash.restore()
        self._stash = None
        if give_back_weights and self._stock_attention is not None:
            self.model.set_attn_implementation(self._stock_attention)
        if self._masks is not None:
            self._masks.close()

    # -- requests (validated by the processor before they get here) ---------
    def add(self, request: Request) -> None:
        params = request.sampling
        if params.min_tokens and request.score is None:  # the ids min_tokens holds back
            eos = () if params.ignore_eos else tuple(self.spec.eos_token_ids)
            request.stop_ids = tuple(sorted({t for t in params.stop_token_ids + eos if 0 <= t < self.spec.vocab_size}))
        spec = params.structured
        if spec is not None and request.grammar is None and request.score is None:
            request.grammar = GrammarState(spec, self.grammars.matcher(spec))
            self._mask_filler().submit([request.grammar])  # the first token's mask, ready by its prefill's end
        if request.lora is not None and self.adapters is not None:  # (the processor refused it without adapters)
            request.cache_salt = self.adapters.salt(request.lora)
        self._stats.prompt_tokens += request.num_tokens if request.score is not None else request.num_prompt_tokens
        self.scheduler.add(request)

    def remove(self, request: Request, status: RequestStatus, reason: str, error: str | None = None) -> None:
        """End a live request now: its blocks go back to the pool at once.

        It is finished first, so that it ends even if giving its blocks back is what fails.
        """
        self.finish(request, status, reason, error)
        self.scheduler.remove(request)
        self.preemptor.discard(request)

    def finish(self, request: Request, status: RequestStatus, reason: str, error: str | None = None) -> None:
        """End a request's life: the one place its final status, reason, error and finish time are set and
        its end is counted in the stats. `remove` it instead while it holds blocks or a queue place.

        Requests the processor refused come here too, from the loop, before they ever run.
        """
        request.status = status
        request.finish_reason = reason
        request.error = error
        request.finish_time = time.perf_counter()
        request.weight_version = request.weight_versions[-1] if request.weight_versions else self.weight_version
        counter = {
            RequestStatus.FINISHED: "finished",
            RequestStatus.FAILED: "failed",
            RequestStatus.CANCELLED: "cancelled",
        }[status]
        setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        request.text = self.detok.final_text(request) if request.num_generated and request.score is None else ""

    def live_requests(self) -> list[Request]:
        return self.scheduler.running + self.scheduler.waiting

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -----------------------------------------------------------
    def step(self) -> StepOutcome:
        """Run one forward over the scheduled work and apply its results."""
        outcome = StepOutcome()
        started = time.perf_counter()
        batch_plan = self.scheduler.schedule()
        for request, message in batch_plan.failed:  # the scheduler already took them out
            self.finish(request, RequestStatus.FAILED, "error", message)
            outcome.finished.append(request)
        if not batch_plan:
            return outcome
        batch = self.builder.build(batch_plan.items)
        try:
            step = self.runner.forward(batch)
            picked = self.backend.sample(step.sampled, batch.sampled) if batch.sampled else None  # [N, V] in
            scored = self._score(batch, step) if batch.scored else None
        except Exception as exc:  # a failing forward fails its batch, not the engine
            log.exception("forward failed")
            for request, _ in batch_plan.items:
                self.remove(request, RequestStatus.FAILED, "error", f"forward failed: {type(exc).__name__}: {exc}")
                outcome.finished.append(request)
            return outcome
        self._advance(batch_plan.items)
        if scored is not None:
            self._record_scores(batch.scored, scored, outcome)
        if picked is not None:
            for row, request in enumerate(batch.sampled):
                top = picked.top[row] if picked.top is not None else None
                self._append(request, picked.token_ids[row], picked.logprobs[row], top, outcome)
            if self._masks is not None:  # next masks computed while the next step's forward runs
                self._masks.submit([r.grammar for r in batch.sampled if r.grammar is not None and not r.status.is_done])
        self._record_step(batch.num_decode, time.perf_counter() - started)
        return outcome

    def _score(self, batch: PagedBatch, step: StepLogits) -> ScoredRows:
        """Logprobs of every kept position's next token, one `SCORE_CHUNK` of rows at a time."""
        targets = torch.tensor(
            [request.score_target(p) for request, first, count in batch.scored for p in range(first, first + count)],
            dtype=torch.long,
        )  # [S]
        top_k = max(request.score.top_logprobs for request, _, _ in batch.scored if request.score is not None)
        total = ScoredRows([], [], [] if top_k else None)
        for start, logits in self.runner.score_chunks(step):  # [c, V]
            part = self.backend.score(logits, targets[start : start + logits.shape[0]], top_k)
            total.logprobs += part.logprobs
            total.greedy += part.greedy
            if top_k:
                assert total.top is not None and part.top is not None  # both made with top_k > 0
                total.top += part.top
        return total

    def _record_scores(self, spans: list[tuple[Request, int, int]], scored: ScoredRows, outcome: StepOutcome) -> None:
        """Append each scoring request's new logprobs; finish the ones whose last token was computed."""
        row = 0
        for request, first, count in spans:
            prompt_end = request.num_prompt_tokens - 1  # positions before it predict prompt tokens
            for offset, position in enumerate(range(first, first + count)):
                index = row + offset
                if position < prompt_end:
                    assert request.prompt_logprobs is not None  # prompt positions are scored only when asked
                    request.prompt_logprobs.append(scored.logprobs[index])
                    continue
                request.logprobs.append(scored.logprobs[index])
                request.weight_versions.append(self.weight_version)
                request.is_greedy &= scored.greedy[index]
                if request.top_logprobs is not None:
                    assert request.score is not None and scored.top is not None  # top_k > 0 for this step
                    request.top_logprobs.append(scored.top[index][: request.score.top_logprobs])
            row += count
            self._stats.scored_tokens += count
        for request, _, _ in spans:
            if request.score_done:
                request.first_token_time = request.first_token_time or time.perf_counter()
                self.remove(request, RequestStatus.FINISHED, "stop")
                outcome.finished.append(request)

    def _advance(self, items: list[tuple[Request, int]]) -> None:
        for request, count in items:
            if request.score is not None:  # every token of a scoring request is input
                self._stats.computed_prompt_tokens += count
            elif request.num_computed_tokens < request.num_prompt_tokens:
                self._stats.computed_prompt_tokens += min(
                    count, request.num_prompt_tokens - request.num_computed_tokens
                )
            request.num_computed_tokens += count
            self.cache.commit(request.key, request.all_token_ids, request.num_computed_tokens, request.cache_salt)
            request.mark_running()

    def _append(
        self,
        request: Request,
        token: int,
        logprob: float,
        top: list[tuple[int, float]] | None,
        outcome: StepOutcome,
    ) -> None:
        """Add a sampled token, then end the request if a stop condition holds (stop_checks.py)."""
        request.all_token_ids.append(token)
        if request.grammar is not None:
            request.grammar.consume(token)
        request.logprobs.append(logprob)
        request.weight_versions.append(self.weight_version)
        if request.top_logprobs is not None and top is not None:
            request.top_logprobs.append(top)
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        self._stats.generated_tokens += 1
        reason = check_stop(request, token, self.spec.eos_token_ids, self.spec.max_context, self.detok)
        if request.grammar is not None and request.grammar.error is not None:
            self.remove(request, RequestStatus.FAILED, "error", request.grammar.error)
            outcome.finished.append(request)
            return
        if request.stream:
            delta = self.detok.stream_delta(request) if reason is None else ""
            outcome.tokens.append(TokenEvent(request, token, logprob, delta))
        if reason is not None:
            self.remove(request, RequestStatus.FINISHED, reason)
            outcome.finished.append(request)

    # -- weights and memory between rollouts ----------------------------------
    def update_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy new weights (name -> tensor) into the model; returns how many. Between steps, with no
        request running: the engine's loop calls it idle, or paused (core_loop.py).

        The backend writes them wherever it keeps the weights (the CPU backend
        packs only the members named, in place, into the one copy it holds),
        and the prefix cache is dropped: its pages hold K/V of the old weights.
        Requests a pause kept give back their K/V for the same reason: they are
        computed again from token 0 under the new weights, their tokens kept, and
        go on from where they stopped. `weight_version` counts the updates.
        """
        if self._stash is not None:
            raise RuntimeError("the weights are parked by sleep(level=2); call wake_up() before updating them")
        self.scheduler.recompute_all()
        try:
            written = self.backend.load_weights(self.model, tensors)  # checks everything before it writes
        finally:
            self.cache.pool.reset_prefix_cache()
        self.weight_version += 1
        return written

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while a request holds blocks."""
        return self.cache.pool.reset_prefix_cache()

    def sleep(self, level: int = 1, weights_to: StashTarget = None) -> None:
        """Give the KV pool (and swap pool) back to the OS; at level 2 the weights too, parked in
        `weights_to` (a file, a directory, a dict) or a private temp file. Idle or paused engines only: requests
        a pause kept are computed again after wake_up."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level!r}")
        self.scheduler.recompute_all()  # requests a pause kept: their K/V goes with the pool, recomputed after
        self.cache.pool.reset_prefix_cache()
        self.cache.pool.touched = 0
        self.preemptor.release()
        self.store.release()
        if level == 2:
            self.backend.close()
            self._stash = WeightStash(self.model, weights_to)
        give_back_memory()

    @property
    def sleeping(self) -> bool:
        """Whether the KV pool or the weights are given away (no step can run)."""
        return self._stash is not None or self.store.data is None

    def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Bring back what `sleep` gave away: identical weights, a fresh (empty) KV pool.

        Either part alone (vLLM's wake-up tags): weights first lets a trainer load
        new ones before the cache takes its memory back.
        """
        if weights and self._stash is not None:
            self._stash.restore()
            self._stash = None
            self._install_backend()
        if not kv_cache or self.store.data is not None:
            return
        self.store.allocate()
        self.preemptor.reallocate()
        if self.config.prefault_blocks:
            prefault = min(self.config.prefault_blocks, self.store.num_blocks)
            self.store.prefault(prefault)
            self.cache.pool.touched = prefault

    def _install_backend(self) -> None:
        """Install the backend on the model again; the batch builder takes the metadata builder it chose."""
        self.backend.install(self.model, self.spec)
        self.builder.metadata = self.backend.metadata_builder

    def _mask_filler(self) -> MaskFiller:
        if self._masks is None:
            self._masks = MaskFiller(self.spec.vocab_size)
        return self._masks

    # -- statistics ---------------------------------------------------------
    def _record_step(self, decodes: int, seconds: float) -> None:
        stats = self._stats
        stats.steps += 1
        stats.busy_s += seconds
        if decodes:
            stats.decode_steps += 1
            stats.decode_batch_tokens += decodes
        stats.peak_blocks_used = max(stats.peak_blocks_used, self.cache.pool.num_used)

    def stats(self) -> StatsSnapshot:
        """A copy of the counters with current queue and cache occupancy filled in."""
        return snapshot(self._stats, self.scheduler, self.cache.pool, self.preemptor.counters, self._started)
