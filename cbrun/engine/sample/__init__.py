"""Tokens from logits: sampling and logprobs (sampler.py), teacher-forced logprobs (scoring.py),
the packed token masks of structured outputs and min_tokens (token_masks.py).

Below the backends, as vLLM keeps its sampler in `vllm/v1/sample/`: a backend
calls these with its compiled kernels (kernels.py says which calls), and
nothing here imports a backend, the step or the grammar (engine/grammar.py
makes the masks; the sampler finds them on each request).
"""
