"""How long `update_weights` takes from an in-process state dict, against reading the weights once (issue 34).

    python scripts/weight_sync.py                                   # random:qwen2.5-0.5b and random:qwen2.5-1.5b, bf16
    python scripts/weight_sync.py --model random:qwen2.5-0.5b --dtype float32 --repeats 5

For each model (random weights at a real shape, cbrun/bench/random_model.py; built and saved once) it
loads two copies, an engine's and a trainer's, and times:

- `read once`: reading every tensor of the trainer's state dict from memory once (a max over its bytes
  as integer words): the floor any sync pays;
- `update (every weight changed)`: `engine.update_weights(trainer.state_dict())` after every parameter
  of the trainer was changed in place (negated), as an optimizer step changes them;
- `update (nothing changed)`: the same call again with nothing changed.

each the best of the repeats (interleaved, so that a busy machine slows each alike), and prints each
with its ratio to `read once` (the issue's target: the changed update within 2x). The
state dict's tensors share the trainer's memory, as an RL trainer's do; where the engine can read a
tensor as it is (same dtype and layout) it takes it instead of copying it, and bf16 linear weights are
packed into the pair-dot layout, once per tensor given.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cbrun.bench.random_model import random_model_dir
from cbrun.engine import Engine, EngineConfig
from cbrun.models import load_model

DEFAULT_MODELS = ("random:qwen2.5-0.5b", "random:qwen2.5-1.5b")


def unique_tensors(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The state dict's tensors, each storage once (a tied embedding and head are one tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in state.values():
        seen.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return list(seen.values())


def read_once(tensors: list[torch.Tensor]) -> float:
    """Seconds to read every byte of `tensors` once: a max over each tensor's bytes as integer words (no float
    slow paths), on torch's threads."""
    started = time.perf_counter()
    for tensor in tensors:
        flat = tensor.reshape(-1)
        size = flat.numel() * flat.element_size()
        words = flat.view(torch.int32 if size % 4 == 0 else torch.int16 if size % 2 == 0 else torch.uint8)
        words.amax()
    return time.perf_counter() - started


def measure(spec: str, dtype: str, repeats: int) -> None:
    directory = random_model_dir(spec, dtype)
    model, tokenizer = load_model(str(directory), dtype=dtype)
    trainer, _ = load_model(str(directory), dtype=dtype)
    state = trainer.state_dict()  # detached views of the trainer's own parameters
    tensors = unique_tensors(state)
    size = sum(t.numel() * t.element_size() for t in tensors)
    read_once(tensors)  # warm
    with Engine(model, tokenizer, EngineConfig(num_blocks=16)) as engine:
        engine.update_weights(state)  # the first sync: the engine takes what it can share
        reads, changed, same = [], [], []
        for _ in range(repeats):  # interleaved, so that a busy machine slows each measure alike
            reads.append(read_once(tensors))
            with torch.no_grad():
                for parameter in trainer.parameters():
                    parameter.neg_()  # every weight changes, in place (its memory stays the trainer's)
            started = time.perf_counter()
            engine.update_weights(state)
            changed.append(time.perf_counter() - started)
            started = time.perf_counter()
            engine.update_weights(state)
            same.append(time.perf_counter() - started)
        held = engine.weight_bytes()
    read, best, median, unchanged = min(reads), min(changed), statistics.median(changed), min(same)
    print(
        f"{spec} {dtype}: {size / 2**30:.2f} GiB of weights ({held / 2**30:.2f} GiB held by the engine), "
        f"{torch.get_num_threads()} threads; read once {read:.3f}s; "
        f"update (every weight changed) {best:.3f}s best, {median:.3f}s median = {best / read:.2f}x read; "
        f"update (nothing changed) {unchanged:.3f}s = {unchanged / read:.2f}x read",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="random:NAME (repeatable); default: the 0.5B and 1.5B shapes")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for spec in args.model or DEFAULT_MODELS:
        measure(spec, args.dtype, args.repeats)


if __name__ == "__main__":
    main()
