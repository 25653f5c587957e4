"""Paged KV-cache bookkeeping: per-request block tables over the shared block pool.

A block is one page in every layer: one id of the pool (`num_blocks` of them),
naming `page_size` tokens of K and V in each layer's page pool (kv_store.py).
"Block" is the id the allocators count, "page" the same unit seen in one layer;
there is no other unit between them. A hybrid model's allocators draw from the
one pool, and a block's content is meaningful in the layers of the attention
type whose allocator holds it. Full-attention layers keep every page and share
hashed prefix pages across requests; sliding-window layers keep only the
pages their window can still reach. `KVCacheManager` makes every operation
all-or-nothing across allocators. Plain Python, no torch; the tensors live
in `kv_store.py`, the pool in `block_pool.py`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from cbrun.engine.cache.block_pool import BlockPool, chain_hash

RequestKey = Hashable

__all__ = ["BlockPool", "FullAttentionAllocator", "KVCacheManager", "SlidingWindowAllocator", "chain_hash"]


class _TableAllocator:
    """Per-request block tables drawn from a shared pool (the part both allocator kinds share)."""

    supports_sharing = False

    def __init__(self, pool: BlockPool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self.tables: dict[RequestKey, list[int]] = {}

    def _pages_covered(self, key: RequestKey) -> int:
        return len(self.tables.get(key, ()))

    def blocks_needed(self, key: RequestKey, num_tokens: int) -> int:
        """New blocks required so that `num_tokens` tokens have a slot."""
        return max(0, -(-num_tokens // self.page_size) - self._pages_covered(key))

    def allocate(self, key: RequestKey, num_tokens: int) -> bool:
        """Grow the table to hold `num_tokens` tokens; False (and no change) if the pool is short."""
        needed = self.blocks_needed(key, num_tokens)
        blocks = self.pool.allocate(needed) if needed else []
        if blocks is None:
            return False
        self.tables.setdefault(key, []).extend(blocks)
        return True

    def _release_table(self, key: RequestKey) -> None:
        """Release the request's blocks, tail first; hashed content survives as cached."""
        self.pool.release(self.tables.pop(key, [])[::-1])

    def table(self, key: RequestKey) -> list[int]:
        return self.tables.get(key, [])


class FullAttentionAllocator(_TableAllocator):
    """Block tables for full-attention layers: one block per page of every token.

    Supports prefix sharing: full blocks are registered in the pool by their
    chained content hash once all their tokens are computed.
    """

    supports_sharing = True

    def __init__(self, pool: BlockPool, page_size: int, share_prefixes: bool) -> None:
        super().__init__(pool, page_size)
        self.share_prefixes = share_prefixes
        self._hashes: dict[RequestKey, list[bytes]] = {}

    def match_prefix(self, key: RequestKey, token_ids: Sequence[int], salt: bytes | None = None) -> int:
        """Attach cached blocks for the longest hashed prefix; returns tokens reused.

        The last token is never matched: its logits are needed, so at least
        one token is always computed. `salt` roots the hash chain: K/V that
        another computation made (a LoRA adapter's) never matches the base
        model's or another adapter's.
        """
        if not self.share_prefixes or self.tables.get(key):
            return 0
        page = self.page_size
        hashes: list[bytes] = []
        blocks: list[int] = []
        parent = salt
        for start in range(0, len(token_ids) - 1 - page + 1, page):
            tokens = token_ids[start : start + page]
            block_hash = chain_hash(parent, tokens)
            block = self.pool.lookup(block_hash, tokens)
            if block is None:
                break
            hashes.append(block_hash)
            blocks.append(block)
            parent = block_hash
        for block in blocks:
            self.pool.share(block)
        self.tables[key] = blocks
        self._hashes[key] = hashes
        return len(blocks) * page

    def commit(self, key: RequestKey, token_ids: Sequence[int], num_computed: int, salt: bytes | None = None) -> None:
        """Hash and register every block whose tokens are now all computed (the chain rooted at `salt`)."""
        if not self.share_prefixes:
            return
        table = self.tables.get(key, [])
        hashes = self._hashes.setdefault(key, [])
        page = self.page_size
        while len(hashes) < min(num_computed // page, len(table)):
            index = len(hashes)
            tokens = token_ids[index * page : (index + 1) * page]
            block_hash = chain_hash(hashes[-1] if hashes else salt, tokens)
            self.pool.register(table[index], block_hash, tokens)
            hashes.append(block_hash)

    def hashes_between(
        self, key: RequestKey, token_ids: Sequence[int], start: int, end: int, salt: bytes | None = None
    ) -> list[bytes]:
        """Chain hashes of the full blocks lying in tokens [start, end) (start on a block boundary)."""
        if not self.share_prefixes or start % self.page_size:
            return []
        known = self._hashes.get(key, [])
        page = self.page_size
        parent = (known[start // page - 1] if len(known) >= start // page else None) if start else salt
        if start and parent is None:
            return []
        out = []
        for begin in range(start, end - page + 1, page):
            parent = chain_hash(parent, token_ids[begin : begin + page])
            out.append(parent)
        return out

    def adopt(self, key: RequestKey, blocks: list[int], first_page: int = 0) -> None:
        """Take ownership of freshly allocated blocks (restoring an offloaded request)."""
        self.tables[key] = list(blocks)
        self._hashes.pop(key, None)

    def free(self, key: RequestKey) -> None:
        """Release the request's blocks (tail first); cached content survives."""
        self._hashes.pop(key, None)
        self._release_table(key)


class SlidingWindowAllocator(_TableAllocator):
    """Block tables for sliding-window layers: only the last `window` tokens are kept.

    The table covers pages from `first_page[key]` on; pages that fall wholly
    outside the window of every future query are released and recycled, so a
    request holds at most about window / page_size + 2 blocks.
    """

    def __init__(self, pool: BlockPool, page_size: int, window: int) -> None:
        super().__init__(pool, page_size)
        self.window = window
        self.first_page: dict[RequestKey, int] = {}

    def _pages_in_use(self, key: RequestKey, num_computed: int) -> int:
        """Index of the first page some future query may still read."""
        oldest_needed = max(0, num_computed - self.window + 1)
        return oldest_needed // self.page_size

    def _pages_covered(self, key: RequestKey) -> int:
        return self.first_page.get(key, 0) + len(self.tables.get(key, ()))

    def allocate(self, key: RequestKey, num_tokens: int) -> bool:
        self.first_page.setdefault(key, 0)
        return super().allocate(key, num_tokens)

    def match_prefix(self, key: RequestKey, token_ids: Sequence[int], salt: bytes | None = None) -> int:
        return 0

    def adopt(self, key: RequestKey, blocks: list[int], first_page: int = 0) -> None:
        self.tables[key] = list(blocks)
        self.first_page[key] = first_page

    def commit(self, key: RequestKey, token_ids: Sequence[int], num_computed: int, salt: bytes | None = None) -> None:
        """Release pages that no future query can attend to."""
        table = self.tables.get(key)
        if not table:
            return
        keep_from = self._pages_in_use(key, num_computed)
        drop = min(keep_from - self.first_page[key], len(table) - 1)
        if drop > 0:
            self.pool.release(table[:drop][::-1])
            del table[:drop]
            self.first_page[key] += drop

    def free(self, key: RequestKey) -> None:
        self.first_page.pop(key, None)
        self._release_table(key)


class KVCacheManager:
    """All allocators of a model over one pool; every operation is all-or-nothing.

    A model has one allocator per attention type ("full", "sliding"). A
    request is admitted or grown only if every allocator has room; prefix
    sharing is on only when every allocator supports it.
    """

    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        *,
        sliding_window: int | None,
        has_full_layers: bool,
        allow_block_sharing: bool,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.page_size = page_size
        self.allocators: dict[str, FullAttentionAllocator | SlidingWindowAllocator] = {}
        if sliding_window is not None:
            self.allocators["sliding"] = SlidingWindowAllocator(self.pool, page_size, sliding_window)
        share = allow_block_sharing and sliding_window is None
        if has_full_layers:
            self.allocators["full"] = FullAttentionAllocator(self.pool, page_size, share)
        self.sharing = share

    def blocks_needed(self, key: RequestKey, num_tokens: int) -> int:
        return sum(a.blocks_needed(key, num_tokens) for a in self.allocators.values())

    def can_allocate(self, key: RequestKey, num_tokens: int) -> bool:
        return self.blocks_needed(key, num_tokens) <= self.pool.num_free

    def allocate(self, key: RequestKey, num_tokens: int) -> bool:
        """Give the request slots for `num_tokens` tokens in every allocator, or change nothing."""
        if not self.can_allocate(key, num_tokens):
            return False
        for allocator in self.allocators.values():
            ok = allocator.allocate(key, num_tokens)
            assert ok, "pool shrank between check and allocation"
        return True

    def match_prefix(self, key: RequestKey, token_ids: Sequence[int], salt: bytes | None = None) -> int:
        if not self.sharing:
            return 0
        return self.allocators["full"].match_prefix(key, token_ids, salt)

    def commit(self, key: RequestKey, token_ids: Sequence[int], num_computed: int, salt: bytes | None = None) -> None:
        for allocator in self.allocators.values():
            allocator.commit(key, token_ids, num_computed, salt)

    def free(self, key: RequestKey) -> None:
        for allocator in self.allocators.values():
            allocator.free(key)

    def blocks_of(self, key: RequestKey) -> dict[str, list[int]]:
        return {name: list(a.table(key)) for name, a in self.allocators.items()}

    def hashes_between(
        self, key: RequestKey, token_ids: Sequence[int], start: int, end: int, salt: bytes | None = None
    ) -> list[bytes]:
        if not self.sharing:
            return []
        full = self.allocators["full"]
        assert isinstance(full, FullAttentionAllocator)  # sharing implies no sliding window: "full" is one
        return full.hashes_between(key, token_ids, start, end, salt)

    def exclusive_blocks(self, key: RequestKey) -> int:
        """Blocks that freeing this request would return to the pool."""
        ref = self.pool.ref_count
        return sum(1 for a in self.allocators.values() for b in a.table(key) if ref[b] == 1)

    def first_page(self, group: str, key: RequestKey) -> int:
        allocator = self.allocators[group]
        return allocator.first_page.get(key, 0) if isinstance(allocator, SlidingWindowAllocator) else 0

    def max_blocks_for(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens holds at its peak, over all allocators."""
        pages = -(-num_tokens // self.page_size)
        total = 0
        for allocator in self.allocators.values():
            if isinstance(allocator, SlidingWindowAllocator):
                total += min(pages, allocator.window // self.page_size + 2)
            else:
                total += pages
        return total
