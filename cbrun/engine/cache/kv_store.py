"""The KV-cache tensors: one page pool per layer, addressed by block id.

Layout per layer: K and V each `[H_kv, num_blocks, page_size, D]`, so that
gathering a sequence's pages (`index_select` on dim 1) yields
`[H_kv, pages, page_size, D]`, which is already the layout attention wants
(heads outermost), with no transpose copy.

On CPU the pool is allocated with calloc (through numpy): the OS hands out
zeroed pages lazily, so a large pool costs nothing at start and resident
memory grows only as pages are touched. Zeros matter: padding pages read by
batched attention are masked, and must hold finite values, never garbage.
A first touch is not free (on the VM measured, ~5 ms per MiB of host-side
faults, with or without transparent huge pages), so the block pool reuses
touched blocks before fresh ones, and `prefault` touches blocks up front.
"""

from __future__ import annotations

import numpy as np
import torch

from cbrun.engine.model_spec import KVShape


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero tensor; on CPU backed by calloc so untouched pages cost no RAM."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.tensor([], dtype=dtype).element_size()
    numpy_type = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[element]
    return torch.from_numpy(np.zeros(shape, dtype=numpy_type)).view(dtype)


class KVStore:
    """All layers' K/V page pools in one allocation."""

    def __init__(self, shape: KVShape, num_blocks: int, page_size: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.device = device
        self.data: torch.Tensor | None = None
        self.allocate()

    def allocate(self) -> None:
        """(Re)create the zeroed pools; lazily backed on CPU, so this costs no resident memory yet."""
        shape = self.shape
        # [layers, 2, H_kv, num_blocks, page, D]
        self.data = zeros(
            (shape.num_layers, 2, shape.num_kv_heads, self.num_blocks, self.page_size, shape.head_dim),
            shape.dtype,
            self.device,
        )

    def release(self) -> None:
        """Give the pools' memory back (sleep); `allocate` brings zeroed pools back."""
        self.data = None

    def prefault(self, num_blocks: int) -> None:
        """Touch the memory of blocks [0, num_blocks) in every layer, K and V (the ids handed out first)."""
        if num_blocks > 0:
            assert self.data is not None, "the pools are released (asleep)"
            self.data[:, :, :, :num_blocks].zero_()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools of one layer, each [H_kv, num_blocks, page, D]."""
        assert self.data is not None, "the pools are released (asleep)"
        return self.data[layer_idx, 0], self.data[layer_idx, 1]

    @property
    def nbytes(self) -> int:
        return self.shape.bytes_per_block(self.page_size) * self.num_blocks  # also while released
