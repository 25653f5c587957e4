"""The block pool and the prefix-cache index: which block ids are free, cached or used.

Blocks are reference counted. A freed block whose content was hashed stays
"cached": it is free, but a later request with the same prefix can take it
back. Cached blocks are evicted (their hash dropped) only when no never-used
block is left, oldest first, and a sequence's tail blocks before its head, so
the shared heads of prefixes survive longest.

    pool:  [ used (ref>0) | cached (ref 0, hashed, LRU) | uninitialized ]

Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Stable content hash of one full block, chained with its parent's.

    blake2b over the parent hash and the token ids as int64 bytes: the same
    on every run and process (Python's `hash()` is salted).
    """
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockPool:
    """A fixed set of block ids with reference counts and a content-hash index."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self._uninitialized: list[int] = list(range(num_blocks - 1, -1, -1))  # LIFO: reuse warm pages first
        # Blocks [0, touched) have been handed out (or prefaulted) before: their memory is
        # resident. Fresh blocks are taken in id order, so this one number tracks it.
        self.touched = 0
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: first = evict first
        self._hash_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0

    # -- capacity -------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never-used plus cached)."""
        return len(self._uninitialized) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # -- allocation -----------------------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """Take `count` fresh blocks (ref 1), or None and take nothing."""
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            block = self._take_one()
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def _take_one(self) -> int:
        """A free block: warm never-used memory first, then the least recently used cached block,
        and only then memory never touched.

        Touching new memory costs page faults (on the VMs measured, ~5 ms per MiB)
        and grows resident memory for good, so the pool's footprint follows the
        working set instead of the run's history; cached prefixes stay until
        their blocks are needed.
        """
        if self._uninitialized and (self._uninitialized[-1] < self.touched or not self._cached):
            block = self._uninitialized.pop()
            self.touched = max(self.touched, block + 1)
            return block
        block, _ = self._cached.popitem(last=False)
        self._forget(block)
        self.evictions += 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free.

        Callers pass a sequence's blocks tail first so that its tail is
        evicted before the shared head.
        """
        for block in blocks:
            count = self.ref_count[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            self.ref_count[block] = count
            if count == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._uninitialized.append(block)

    # -- prefix cache ---------------------------------------------------
    def lookup(self, block_hash: bytes, tokens: Sequence[int]) -> int | None:
        """The block holding exactly these tokens under this hash chain, if any."""
        block = self._block_of.get(block_hash)
        if block is None or self._tokens_of[block] != tuple(tokens):
            return None
        return block

    def share(self, block: int) -> None:
        """Take one more reference to a hashed block (reviving it if cached)."""
        if self.ref_count[block] == 0:
            del self._cached[block]
        self.ref_count[block] += 1

    def register(self, block: int, block_hash: bytes, tokens: Sequence[int]) -> None:
        """Record that `block` now holds these tokens (first writer wins)."""
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self._tokens_of[block] = tuple(tokens)
        self._block_of[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (their content is stale: new weights, or memory given back).

        Only when no block is in use, as vLLM does: returns False and changes
        nothing otherwise. Cached blocks become never-used ones, lowest id first.
        """
        if self.num_used:
            return False
        for block in list(self._hash_of):
            self._forget(block)
        self._uninitialized.extend(self._cached)
        self._uninitialized.sort(reverse=True)
        self._cached.clear()
        return True

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        del self._tokens_of[block]
        del self._block_of[block_hash]

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this)."""
        free_ids = list(self._uninitialized) + list(self._cached)
        assert len(set(free_ids)) == len(free_ids), "a block is free twice"
        for block in free_ids:
            assert self.ref_count[block] == 0, f"free block {block} has references"
        used = sum(1 for count in self.ref_count if count > 0)
        assert used + len(free_ids) == self.num_blocks, "free + used != total"
        assert all(count >= 0 for count in self.ref_count), "negative reference count"
        for block in self._cached:
            assert block in self._hash_of, "cached block without hash"
        for block_hash, block in self._block_of.items():
            assert self._hash_of[block] == block_hash, "hash maps disagree"
