"""vLLM's `LLM(...)` engine options mapped onto cbrun's `EngineConfig`.

Options with a cbrun meaning are translated; options that only describe a
GPU deployment cbrun cannot be (tensor parallelism, quantization schemes
other than int8, remote code) are accepted at their neutral value and raise `UnsupportedFieldError`
naming them otherwise; names vLLM does not have raise TypeError.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cbrun.engine.config import EngineConfig
from cbrun.llm.params import UnsupportedFieldError

# vLLM option -> EngineConfig field
TRANSLATED = {
    "enable_prefix_caching": "allow_block_sharing",
    "swap_space": "cpu_offload_space",
    "gpu_memory_utilization": "max_memory_percent",  # share of available memory the KV cache may take
    "max_num_seqs": "max_requests_per_batch",
    "max_num_batched_tokens": "max_batch_tokens",
    "block_size": "page_size",
    "num_gpu_blocks_override": "num_blocks",
    "enable_lora": "enable_lora",
    "max_lora_rank": "max_lora_rank",
    "max_loras": "max_loras",
}

# vLLM option -> (neutral value(s), why cbrun cannot honour another)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "tensor_parallel_size": ((1,), "cbrun runs one process on one device"),
    "pipeline_parallel_size": ((1,), "cbrun runs one process on one device"),
    "data_parallel_size": ((1,), "cbrun runs one process on one device"),
    "quantization": (
        (None, "int8"),  # "int8" is EngineConfig.quantization: W8A8 on the CPU kernels
        "cbrun runs dense fp32/bf16/fp16 weights or int8 W8A8 (GGUF files are dequantized at load)",
    ),
    "trust_remote_code": ((False,), "cbrun drives stock transformers models only"),
    "cpu_offload_gb": ((0, 0.0), "cbrun keeps the weights in memory (sleep(level=2) parks them between rollouts)"),
    "kv_cache_dtype": (("auto",), "the KV cache holds the model's dtype"),
    "tokenizer_mode": (("auto",), "cbrun loads the tokenizer transformers picks"),
    "skip_tokenizer_init": ((False,), "cbrun needs the tokenizer"),
    "hf_overrides": ((None,), "cbrun loads the model's config as it is"),
    "enable_chunked_prefill": ((None, True), "cbrun always chunks long prefills"),
    "logprobs_mode": (("raw_logprobs",), "cbrun reports vLLM's default kind, raw logprobs"),
    "hf_token": ((None,), "set HF_TOKEN in the environment instead"),
    "download_dir": ((None,), "cbrun reads the Hugging Face cache (HF_HOME)"),
    "compilation_config": ((None, 0), "cbrun runs its own compiled kernels, not torch.compile"),
    "distributed_executor_backend": ((None, "uni"), "cbrun runs in the calling process"),
}

# accepted because cbrun always behaves as they ask (no CUDA graphs, no sleep-mode allocator needed)
ALWAYS_TRUE_OF_CBRUN = (
    "enforce_eager",
    "enable_sleep_mode",
    "disable_log_stats",
    "max_seq_len_to_capture",
    "disable_custom_all_reduce",
)


def engine_config(base: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """The EngineConfig for these vLLM options over `base` (default EngineConfig())."""
    config = base or EngineConfig()
    changes = {}
    for name, value in options.items():
        if name in TRANSLATED:
            if value is not None:
                changes[TRANSLATED[name]] = value
        elif name in UNSUPPORTED:
            neutral, why = UNSUPPORTED[name]
            if value not in neutral:
                raise UnsupportedFieldError(f"LLM({name}={value!r}) is not supported by cbrun ({why})")
            if name == "quantization" and value is not None:
                changes["quantization"] = value
        elif name not in ALWAYS_TRUE_OF_CBRUN:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
    return replace(config, **changes) if changes else config
