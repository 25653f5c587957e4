"""Runs vLLM's offline `LLM.generate` for `cbrun bench`: a warm-up pass, then a timed pass.

This file imports only the standard library and vLLM, so it can run under
the interpreter of a separate environment (vLLM pins its own torch and
transformers): `python vllm_child.py JOB.json RESULT.json`. The job holds the
model directory, dtype and both passes' token ids and output lengths; the
result holds per-prompt output token counts, TTFTs and timings. Lines starting
with "[vllm]" on stderr report progress to the parent.
"""

import json
import sys
import time

EXIT_IMPORT_ERROR = 3


def log(message):
    print(f"[vllm] {message}", file=sys.stderr, flush=True)


def run(job):
    """Start an LLM from `job`, run its warm-up and timed passes, return the figures as a dict."""
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        tokenizer=job["tokenizer"],
        dtype=job["dtype"],
        seed=job["seed"],
        max_model_len=job["max_model_len"],
        disable_log_stats=False,  # fills RequestOutput.metrics (first-token latency)
        **job.get("llm_kwargs", {}),
    )
    startup_s = time.perf_counter() - start
    log(f"engine started in {startup_s:.1f}s")
    warmup = run_pass(llm, job["warmup"])
    log(f"warm-up done in {warmup['wall_s']:.1f}s")
    timed = run_pass(llm, job["timed"])
    log(f"timed pass done in {timed['wall_s']:.1f}s")
    timed.update(
        vllm_version=vllm.__version__,
        startup_s=startup_s,
        warmup_s=warmup["wall_s"],
        dtype=resolved_dtype(llm, job["dtype"]),
    )
    return timed


def resolved_dtype(llm, asked):
    """The dtype vLLM computes in ("auto" resolved), where its engine says; else what was asked."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    dtype = getattr(config, "dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else asked


def run_pass(llm, spec):
    """One `LLM.generate` call over every request of `spec`; counts are per prompt, summed over samples."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [
        SamplingParams(
            n=spec["n"],
            max_tokens=length,
            ignore_eos=spec["ignore_eos"],
            temperature=spec["temperature"],
            top_p=1.0,
            # no per-request seed: vLLM 0.32's CPU sampler fails on seeded requests
            # ("CPU Generator does not use offset"); the engine-wide seed still applies
            seed=None,
            **structured_kwargs(constraint),
        )
        for length, constraint in zip(spec["output_lens"], spec.get("structured") or [None] * len(spec["prompts"]))
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    ttfts = []
    for out in outputs:
        latency = getattr(out.metrics, "first_token_latency", 0.0) if out.metrics is not None else 0.0
        if latency and latency > 0:
            ttfts.append(latency)
    texts = None
    if spec.get("structured"):  # the parent checks them against the constraints
        texts = [[(c.text, c.finish_reason) for c in out.outputs] for out in outputs]
    return {
        "outputs": texts,
        "wall_s": wall_s,
        "output_counts": [sum(len(c.token_ids) for c in out.outputs) for out in outputs],
        "prompt_tokens": sum(len(out.prompt_token_ids or []) for out in outputs),
        "ttfts": ttfts,
    }


def structured_kwargs(constraint):
    """SamplingParams keyword for a constraint ({"json": schema} / {"regex": ...} / ...), by vLLM version."""
    if not constraint:
        return {}
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:  # vLLM before 0.11
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(**constraint)}
    return {"structured_outputs": StructuredOutputsParams(**constraint)}


def main(argv):
    job_path, result_path = argv[1], argv[2]
    with open(job_path) as f:
        job = json.load(f)
    try:
        import vllm  # noqa: F401
    except Exception as e:  # an unusable install is "unavailable", not a benchmark failure
        print(f"cannot import vllm: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return EXIT_IMPORT_ERROR
    result = run(job)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
