"""Test helpers shared by test modules: tiny offline tokenizer/models and prompt makers.

Everything here is built offline from transformers and tokenizers APIs, so the
fixtures exercise the real `from_pretrained` paths without any download.
"""

from __future__ import annotations

import random
from pathlib import Path

TINY_VOCAB_SIZE = 512  # model vocab; the tokenizer uses fewer ids so every id it makes is valid
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a continuous batching engine schedules prefill and decode tokens every step",
    "paged attention keeps keys and values in fixed size blocks of the cache",
    "hello world, this is a tiny tokenizer for tests; numbers 0123456789!",
    "What is the capital of France? Paris is the capital of France.",
    "user assistant system question answer prompt output request result",
]


def build_tiny_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer (llama-like: prepends <s>) trained on a small in-code corpus.

    Byte-level, so any text encodes; ids 0-2 are <pad>, <s>, </s>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )
    assert len(wrapped) <= TINY_VOCAB_SIZE
    return wrapped


def save_tiny_model(config, tokenizer, directory: Path, seed: int = 0) -> Path:
    """Build a random-weight model for `config` (fixed seed), save it and the tokenizer to `directory`."""
    import torch
    from transformers import AutoModelForCausalLM

    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def make_prompts(tokenizer_or_vocab, lengths, seed: int = 0) -> list[list[int]]:
    """Random prompts (lists of token ids) of the given lengths, reproducible from `seed`.

    With a tokenizer, ids come from its vocabulary minus its special tokens (so a
    prompt never contains eos); with an int, from range(vocab).
    """
    if isinstance(tokenizer_or_vocab, int):
        candidates = list(range(tokenizer_or_vocab))
    else:
        special = set(tokenizer_or_vocab.all_special_ids)
        candidates = [i for i in range(len(tokenizer_or_vocab)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(candidates) for _ in range(n)] for n in lengths]


_GGUF_LAYER_TENSORS = {  # HF llama parameter (under model.layers.N.) -> GGUF tensor (under blk.N.)
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_permute(weight, n_head: int):
    """llama.cpp's q/k row order (convert_hf_to_gguf's `permute`); transformers undoes it on load."""
    rows = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model_dir: Path, path: Path) -> Path:
    """Convert a saved tiny llama (byte-level BPE tokenizer) into an F32 GGUF file, like llama.cpp would.

    Lets tests exercise transformers' real GGUF loading in well under a second.
    """
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    tok = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    _add_gguf_tokenizer(writer, tok, cfg["vocab_size"])
    for name, tensor in _gguf_tensors(weights, cfg):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _add_gguf_tokenizer(writer, tok: dict, vocab_size: int) -> None:
    """Byte-level BPE vocabulary padded to the model's vocab size, with merges and special ids."""
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    # The last slot is <|endoftext|>: transformers' GGUF loader appends that token (GPT2Tokenizer's
    # default unk) past the vocab when the file lacks it, which would yield an out-of-range id.
    tokens = [f"[PAD{i}]" for i in range(vocab_size - 1)] + ["<|endoftext|>"]
    for text, index in vocab.items():
        tokens[index] = text
    special = {added["id"] for added in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special or i >= len(vocab) else 1 for i in range(vocab_size)])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(vocab_size - 1)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def _gguf_tensors(weights: dict, cfg: dict):
    """(gguf name, float32 array) pairs in llama.cpp's naming and q/k row order."""
    yield "token_embd.weight", weights["model.embed_tokens.weight"]
    yield "output_norm.weight", weights["model.norm.weight"]
    yield "output.weight", weights["lm_head.weight"]
    for layer in range(cfg["num_hidden_layers"]):
        for hf, gg in _GGUF_LAYER_TENSORS.items():
            tensor = weights[f"model.layers.{layer}.{hf}.weight"]
            if gg == "attn_q":
                tensor = _gguf_permute(tensor, cfg["num_attention_heads"])
            elif gg == "attn_k":
                tensor = _gguf_permute(tensor, cfg["num_key_value_heads"])
            yield f"blk.{layer}.{gg}.weight", tensor
