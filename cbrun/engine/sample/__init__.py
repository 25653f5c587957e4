"""Tokens from logits: sampling and logprobs (sampler.py), teacher-forced logprobs (scoring.py).

Below the backends, as vLLM keeps its sampler in `vllm/v1/sample/`: a backend
calls these with its compiled kernels (kernels.py says which calls), and
nothing here imports a backend or the step.
"""
