"""`LLM`: vLLM's offline API over cbrun's engine, for scripts (and RL loops) written against vLLM.

    llm = LLM("smollm2-135m", dtype="float32", seed=0)
    outs = llm.generate(prompts, SamplingParams(n=8, temperature=1.0, logprobs=0, max_tokens=64))
    ...train...
    llm.sleep()                  # the KV pool goes back to the OS while the trainer runs
    llm.wake_up()
    llm.update_weights(model.state_dict())   # in place; outputs now equal a fresh engine's

While another thread is inside `generate`, `abort(ids)` ends requests with
their partial output, and `pause_generation(mode)` / `update_weights` /
`resume_generation()` change the weights under it: "abort" returns partial
outputs to `generate`, "wait" lets them finish first, "keep" continues them
on the new weights (each token carries the weights' version it came from).

One call runs in three passes over the same engine: the samples, the prompt
logprobs (teacher-forced scoring of prompt[1:] after prompt[0]) and, only
for requests sampled at a temperature other than 0 and 1 that asked for
logprobs, a scoring pass that turns the engine's tempered logprobs into
vLLM's raw ones (the first two passes are submitted together).
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from cbrun.engine import Engine, EngineConfig, GenerationOutput
from cbrun.engine.model_spec import Tokenizer
from cbrun.engine.sampling_params import SamplingParams as EngineSampling
from cbrun.engine.weights import WeightSource
from cbrun.llm.engine_args import engine_config as translate_options
from cbrun.llm.inputs import ChatOptions, as_prompt_list, encode_prompts, per_prompt, render_chats
from cbrun.llm.lora import LLMAdapters, names
from cbrun.llm.outputs import OutputBuilder, RequestOutput
from cbrun.llm.params import SamplingParams, UnsupportedFieldError
from cbrun.llm.progress import PromptProgress
from cbrun.lora.request import LoRARequest


class LLM:
    """An in-process engine with vLLM's offline interface.

    model: a cbrun model spec (HF directory, hub id, .gguf file, alias such as "smollm2-135m").
    tokenizer / tokenizer_revision: another tokenizer to use. dtype: "auto" (fp32 on CPU),
    "float32", "bfloat16", "float16". seed: requests without a seed of their own draw one from
    it, so a script gives the same samples on every run (None: fresh randomness).
    max_model_len: cap on prompt + completion tokens. device: "auto", "cpu", "cuda".
    engine_config: cbrun's EngineConfig to start from; vLLM's engine options (`**options`:
    enable_prefix_caching, max_num_seqs, max_num_batched_tokens, block_size, swap_space,
    gpu_memory_utilization, enable_lora, max_lora_rank, max_loras, ...) are translated onto it
    (engine_args.py). With enable_lora, generate and chat take `lora_request=` (cbrun/llm/lora.py).
    """

    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        *,
        dtype: Any = "auto",
        seed: int | None = 0,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        max_model_len: int | None = None,
        device: str = "auto",
        engine_config: EngineConfig | None = None,
        **options: Any,
    ) -> None:
        from cbrun.models import load_model

        config = translate_options(engine_config, options)  # bad options fail before the model loads
        loaded, tok = load_model(model, dtype=dtype, device=device, revision=revision)
        if tokenizer is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer, revision=tokenizer_revision)
        self.engine = Engine(loaded, tok, config)
        self.adapters = LLMAdapters(self.engine)  # LoRA (enable_lora=True): lora_request= and the *_lora methods
        self.tokenizer = tok
        self.max_model_len = min(max_model_len or self.engine.max_context, self.engine.max_context)
        self._seeds = random.Random(seed) if seed is not None else None
        self._ids = itertools.count()
        self.output_builder = OutputBuilder(tok, self.engine.core.spec.eos_token_ids)
        self._live: dict[str, SamplingParams] = {}  # requests of a generate call in progress, for abort

    # -- generation ------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
        priority: Any = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, {"prompt": ...}, {"prompt_token_ids": [...]}, or a list of them);
        one RequestOutput per prompt, in input order."""
        _refuse("priority", priority)
        prompts = as_prompt_list(prompts)
        loras = self.adapters.per_prompt(lora_request, len(prompts))
        items = encode_prompts(prompts, self.tokenizer)
        return self._run(items, per_prompt(sampling_params, len(prompts)), use_tqdm, loras)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: Any = None,
        *,
        history_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to a list of conversations.

        Message contents may be strings or OpenAI lists of parts (text parts are joined, media refused).
        Each RequestOutput's prompt_token_ids are the exact ids the template rendered.
        history_token_ids (cbrun's; one list, or one per conversation): the ids of the turns so far (a
        previous output's prompt_token_ids + its completion's token_ids); `messages` are then only the new
        ones, rendered after them and appended, so no earlier token is re-tokenized (data/follow_up.py).
        """
        _refuse("mm_processor_kwargs", mm_processor_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise UnsupportedFieldError(
                "chat(chat_template_content_format=...) is not supported by cbrun: "
                "contents are flattened to strings ('auto' or 'string')"
            )
        options = ChatOptions(add_generation_prompt, continue_final_message, chat_template, tools, chat_template_kwargs)
        items = render_chats(self.tokenizer, messages, history_token_ids, options)
        loras = self.adapters.per_prompt(lora_request, len(items))
        return self._run(items, per_prompt(sampling_params, len(items)), use_tqdm, loras)

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: Any,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        rids = [str(next(self._ids)) for _ in items]  # as vLLM's LLM numbers them: abort() takes these
        engine_params = [self.engine_params(index, ids, p) for index, ((_, ids), p) in enumerate(zip(items, params))]
        self._live.update(zip(rids, params))
        try:
            self.engine.add_requests([ids for _, ids in items], engine_params, rids, names(loras))
            return self._finish_run(rids, items, params, use_tqdm, dict(zip(rids, loras)))
        finally:
            for rid in rids:
                self._live.pop(rid, None)

    def _finish_run(
        self,
        rids: list[str],
        items: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: Any,
        loras: dict[str, LoRARequest | None],
    ) -> list[RequestOutput]:
        """Prompt logprobs and rescoring run each prompt's adapter too (its logprobs are the adapted model's)."""
        scored: dict[str, GenerationOutput | None] = {}
        for rid, (_, ids), p in zip(rids, items, params):
            if p.prompt_logprobs is not None and len(ids) > 1:
                k = _count(p.prompt_logprobs, self.engine.vocab_size)
                lora = names([loras[rid]])[0]
                self.engine.add_score_request(ids[:1], [ids[1:]], f"{rid}/prompt", top_logprobs=k, lora=lora)
                scored[rid] = None
        samples = self._collect(rids, params, scored, use_tqdm)
        raw = self._raw_logprobs(rids, items, params, samples, loras)
        outputs = [
            self._request_output(rid, text, ids, p, samples[rid], scored.get(rid), raw)
            for rid, (text, ids), p in zip(rids, items, params)
        ]
        for output in outputs:
            output.lora_request = loras[output.request_id]
            for completion in output.outputs:
                completion.lora_request = output.lora_request
        return outputs

    def engine_params(self, index: int, ids: list[int], params: SamplingParams) -> EngineSampling:
        """The engine's parameters for prompt `index` (its ids): max_tokens within max_model_len, a seed."""
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt {index}: {len(ids)} tokens leave no room for a completion under "
                f"max_model_len {self.max_model_len}"
            )
        seed = self._seeds.randrange(2**63) if self._seeds is not None and params.seed is None else None
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return params.to_engine(max_tokens, self.engine.vocab_size, seed)

    def _collect(
        self,
        rids: list[str],
        params: list[SamplingParams],
        scored: dict[str, GenerationOutput | None],
        use_tqdm: Any,
    ) -> dict[str, list[GenerationOutput]]:
        """Every sample of every request (and each prompt-scoring result into `scored`), as they finish."""
        wanted = {rid: p.n for rid, p in zip(rids, params)}
        samples: dict[str, list[GenerationOutput]] = defaultdict(list)
        left = sum(wanted.values()) + len(scored)
        with PromptProgress(use_tqdm, len(rids)) as progress:
            while left:
                out = self.engine.get_result(timeout=None)
                left -= 1
                if out.request_id.endswith("/prompt"):
                    scored[out.request_id[: -len("/prompt")]] = out
                    continue
                samples[out.request_id].append(out)
                if len(samples[out.request_id]) == wanted[out.request_id]:
                    progress.advance()
        errors = [
            (i, o)
            for i, rid in enumerate(rids)
            for o in samples[rid] + [scored.get(rid)]
            if o is not None and o.error is not None
        ]
        if errors:
            index, out = errors[0]
            raise ValueError(
                f"prompt {index}: {out.error}" + (f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else "")
            )
        return {rid: sorted(samples[rid], key=lambda o: o.sample_index) for rid in rids}

    def _raw_logprobs(
        self,
        rids: list[str],
        items: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        samples: dict[str, list[GenerationOutput]],
        loras: dict[str, LoRARequest | None],
    ) -> dict[tuple[str, int], GenerationOutput]:
        """(rid, sample) -> teacher-forced logprobs at temperature 1 for samples drawn at another
        temperature: vLLM reports raw logprobs, the engine the tempered ones it drew from."""
        todo = [
            (rid, ids, p, [o for o in samples[rid] if o.token_ids])  # an abort may leave a sample without tokens
            for rid, (_, ids), p in zip(rids, items, params)
            if p.logprobs is not None and not p.greedy and p.temperature != 1.0
        ]
        todo = [entry for entry in todo if entry[3]]
        for rid, ids, p, outs in todo:
            self.engine.add_score_request(
                ids,
                [o.token_ids for o in outs],
                f"{rid}/raw",
                samples=[o.sample_index for o in outs],
                top_logprobs=_count(p.logprobs or 0, self.engine.vocab_size),  # todo holds rows with logprobs
                lora=names([loras[rid]])[0],
            )
        raw: dict[tuple[str, int], GenerationOutput] = {}
        for _ in range(sum(len(outs) for *_, outs in todo)):
            out = self.engine.get_result(timeout=None)
            if out.error is not None:
                raise ValueError(f"rescoring {out.request_id}: {out.error}")
            raw[(out.request_id[: -len("/raw")], out.sample_index)] = out
        return raw

    def _request_output(
        self,
        rid: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        samples: list[GenerationOutput],
        prompt_scored: GenerationOutput | None,
        raw: dict[tuple[str, int], GenerationOutput],
    ) -> RequestOutput:
        outputs = []
        for out in samples:
            again = raw.get((rid, out.sample_index))
            if again is None:
                outputs.append(self.output_builder.completion(out, params, None, None))
            else:
                outputs.append(self.output_builder.completion(out, params, again.logprobs, again.top_logprobs))
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = self.output_builder.prompt_logprobs(ids, prompt_scored)
        return RequestOutput(
            rid,
            text,
            list(ids),
            prompt_logprobs,
            outputs,
            num_cached_tokens=min((o.num_cached_tokens for o in samples), default=0),
        )

    # -- abort, pause and weights between (or during) rollouts ------------------------------------
    def abort(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """End requests of a `generate`/`chat` in progress (in another thread) now; returns what each had
        produced, finish_reason "abort" (that call gets the same partial outputs). Request ids are the
        RequestOutput ids, numbered from "0" in submission order as vLLM's LLM does; ids not live are skipped."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        params = {rid: self._live.get(rid) or SamplingParams() for rid in ids}  # before generate returns
        outputs: dict[str, list[GenerationOutput]] = defaultdict(list)
        for out in self.engine.abort(ids):
            outputs[out.request_id].append(out)
        return [
            RequestOutput(
                rid,
                None,
                list(outs[0].prompt_token_ids),
                None,
                [self.output_builder.completion(out, params[rid]) for out in outs],
            )
            for rid, outs in outputs.items()
        ]

    def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause before a weight update: "abort" ends in-flight requests with their partial output,
        "wait" (or "finish") returns once they have finished on the current weights, "keep" holds them to go
        on at `resume_generation` (under the new weights if updated meanwhile). New requests wait for resume."""
        self.engine.pause_generation(mode, clear_cache)

    def resume_generation(self) -> None:
        self.engine.resume_generation()

    def is_paused(self) -> bool:
        return self.engine.is_paused()

    @property
    def weight_version(self) -> int:
        """How many updates the weights have had: the version outputs record per token."""
        return self.engine.weight_version

    def update_weights(self, weights: WeightSource, pause_mode: str | None = None) -> int:
        """Load new weights in place (a state dict in any dtype, (name, tensor) pairs, a safetensors file
        or a checkpoint directory); cached prefixes are dropped. Returns how many tensors were written.
        Between rollouts, while paused, or with `pause_mode` ("abort", "wait", "keep"): pause, update, resume."""
        return self.engine.update_weights(weights, pause_mode)

    def sleep(self, level: int = 1, weights_to: Any = None) -> None:
        """Give the KV cache back to the OS (level 1), and the weights too (level 2: parked in
        `weights_to`, a file, directory or dict, else a temp file) until `wake_up`."""
        self.engine.sleep(level, weights_to)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep gave away (tags: None, or "weights" and/or "kv_cache")."""
        self.engine.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    # -- LoRA adapters (LLM(enable_lora=True)) -------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter now (generate loads it on first use anyway)."""
        self.adapters.ensure(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.adapters.remove(lora_id)

    def list_loras(self) -> set[int]:
        return set(self.engine.loras.list().values())

    def update_lora(
        self,
        name: str,
        state_dict: Mapping[str, Any],
        *,
        config: Mapping[str, Any] | None = None,
        lora_int_id: int | None = None,
        pause_mode: str | None = None,
    ) -> None:
        """Replace adapter `name`'s A and B in place from a PEFT state dict (get_peft_model_state_dict), no file;
        an adapter not loaded yet is added from it with `config` (lora_alpha at least). As update_weights:
        between rollouts, paused, or with `pause_mode`."""
        self.adapters.update(name, state_dict, config, lora_int_id, pause_mode)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def close(self) -> None:
        """Stop the engine thread and free its memory."""
        self.engine.stop()
        self.engine.destroy()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _count(k: int, vocab_size: int) -> int:
    return vocab_size if k == -1 else k


def _refuse(name: str, value: Any) -> None:
    if value is not None:
        raise UnsupportedFieldError(f"{name} is not supported by cbrun; leave it None")
