"""BlockManager: which physical KV-cache blocks each sequence holds, and the prefix cache.

The cache is num_blocks blocks of block_size token slots each (per layer, K and V alike; the
runner owns the memory, this class only hands out block ids). A sequence's block table maps its
logical blocks to physical ones; positions run through them in order:

    block_size = 4, sequence of 10 tokens (prompt 7 + 3 generated), block_table = [5, 0, 8]

    position      0  1  2  3 | 4  5  6  7 | 8  9  .  .
    logical blk   0          | 1          | 2
    physical blk  5          | 0          | 8
    slot          20 21 22 23| 0  1  2  3 | 32 33 34 35       slot = block * block_size + offset
                  <------ num_cached_tokens = 9 ----->| 9: the newest token, its K/V are written
                                                         by the next decode step
A decode step writes K/V for position num_tokens - 1; when that position starts a new block
(num_tokens - 1 is a multiple of block_size) the sequence needs one more block first.

Prefix caching (automatic, as in vLLM V1). A full block whose K/V are computed is *published*
under a hash chained over (its parent block's hash, its own token ids), so that one hash names
the whole prefix up to the block's end. A sequence with no blocks first takes the longest chain
of published blocks matching its tokens (never all of them: its last token must run, for
logits) and computes only the rest; its own blocks are published as they fill, prompt and
decode alike. Blocks are reference counted; a block whose count drops to 0 is free, but keeps
its K/V and hash until the allocator hands it out again. The free queue is in eviction order:
unpublished blocks first (they are worth nothing), then published ones least recently freed
first, a sequence's tail before its head (a chain is only of use from its start).

Invariants:
    len(block_table) == ceil(tokens that have or are about to have K/V / block_size)
    ref_count(b) == the number of block tables holding b; b is in the free queue iff it is 0
    a block in more than one table is published: full, its K/V computed and never rewritten
    (a shared block lies below every sharer's num_cached_tokens, and writes go above)

Each block table is also copied into a row of `tables` (int32, -1 padded; the row number is
seq.block_table_row while the sequence holds blocks), so that a decode batch's block tables are
one numpy gather, `tables[rows, :width]`, rather than a Python loop over the sequences.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tinyvllm.engine.sequence import Sequence

ROOT_HASH = b""                       # the parent of a sequence's first block


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The chain hash of a full block: 128-bit BLAKE2b over the parent's hash and the token ids
    as uint32 (stable across processes, unlike the salted built-in hash())."""
    return hashlib.blake2b(parent + array("I", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups counted in tokens, as vLLM counts them: every admission of a sequence
    without blocks (a new request, or a preempted one coming back) queries all its tokens, and
    the tokens its cached blocks cover are hits. Cumulative; all 0 with caching off."""
    requests: int = 0                 # admissions that looked the cache up
    queries: int = 0                  # tokens looked up
    hits: int = 0                     # tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: next out
        self._holders: list[set[Sequence]] = [set() for _ in range(num_blocks)]   # the refcounts
        self._hash: list[bytes | None] = [None] * num_blocks     # a published block's hash
        self._published: dict[bytes, int] = {}                   # hash -> block
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_evictions = 0                # published blocks handed out again
        self.tables = np.full((16, 16), -1, np.int32)   # grows by doubling as needed
        self._free_rows = list(range(16))

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (published ones among them stay cached until reused)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Published blocks, held or free."""
        return len(self._published)

    def ref_count(self, block: int) -> int:
        return len(self._holders[block])

    # -- the prefix cache ------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The published blocks a sequence without blocks would start from: the longest chain
        matching its tokens, short of its last token. [] when it has blocks or caching is off."""
        if not self.enable_caching or seq.block_table:
            return []
        n = (seq.num_tokens - 1) // self.block_size
        self._hash_blocks(seq, n)
        blocks = []
        for h in seq.block_hashes[:n]:
            block = self._published.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def uncached_block_hashes(self, seq: Sequence, cached: list[int]) -> list[bytes]:
        """The hashes of the full blocks a sequence without blocks would compute after its
        `cached` ones (those its admission would publish); [] when it has blocks or caching is off."""
        if not self.enable_caching or seq.block_table:
            return []
        return seq.block_hashes[len(cached):(seq.num_tokens - 1) // self.block_size]

    def block_hashes_between(self, seq: Sequence, start: int, end: int) -> list[bytes]:
        """The hashes of the sequence's full blocks that tokens [start, end) complete (a step's
        prompt chunk: the blocks it will publish); [] when caching is off."""
        if not self.enable_caching:
            return []
        first, last = start // self.block_size, min(end, seq.num_tokens) // self.block_size
        self._hash_blocks(seq, last)
        return seq.block_hashes[first:last]

    def publish(self, seq: Sequence) -> None:
        """Publish the sequence's full blocks whose K/V are computed (after each prefill step, when
        decode moves into a new block, and when the sequence lets its blocks go). A block whose
        hash another block already has stays private: the first one remains the cached one."""
        full = seq.num_cached_tokens // self.block_size
        if not self.enable_caching or full <= seq.num_published_blocks:
            return
        self._hash_blocks(seq, full)
        hashes = seq.block_hashes
        for i in range(seq.num_published_blocks, full):
            if hashes[i] not in self._published:
                self._published[hashes[i]] = seq.block_table[i]
                self._hash[seq.block_table[i]] = hashes[i]
        seq.num_published_blocks = full

    def reset_prefix_cache(self) -> bool:
        """Forget every published block (benchmarks: runs that must not hit each other's blocks).
        Only while no sequence holds a block; -> whether it was done."""
        if len(self._free) < self.num_blocks:
            return False
        self._published.clear()
        self._hash = [None] * self.num_blocks
        return True

    def _hash_blocks(self, seq: Sequence, n: int) -> None:
        """Extend seq.block_hashes to the chain hashes of its first n blocks (full ones). Each is
        computed once: a sequence's tokens only ever grow, so the hashes stay valid."""
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), n):
            hashes.append(block_hash(hashes[i - 1] if i else ROOT_HASH, seq.token_ids[i * bs:(i + 1) * bs]))

    # -- prefill: blocks for every token the sequence has (prompt, or prompt + generated when a
    #    preempted sequence is recomputed), `cached` ones (see cached_prefix) first --
    def blocks_needed(self, seq: Sequence, cached: list[int] = ()) -> int:
        return max(0, blocks_for(seq.num_tokens, self.block_size) - len(seq.block_table) - len(cached))

    def can_allocate(self, seq: Sequence, cached: list[int] | None = None) -> bool:
        cached = self.cached_prefix(seq) if cached is None else cached
        revived = sum(not self._holders[b] for b in cached)     # free now: they count against the free
        return self.blocks_needed(seq, cached) + revived <= len(self._free)

    def allocate(self, seq: Sequence, cached: list[int] | None = None) -> None:
        """A sequence without blocks takes `cached` (default: its cached_prefix), whose tokens
        count as computed; then fresh blocks for the rest of its tokens."""
        cached = self.cached_prefix(seq) if cached is None else cached
        if not self.can_allocate(seq, cached):
            raise RuntimeError(f"allocate({seq.request_id}): {self.blocks_needed(seq, cached)} blocks "
                               f"needed besides {len(cached)} cached, {len(self._free)} free")
        if self.enable_caching and not seq.block_table:
            hit_tokens = len(cached) * self.block_size
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += seq.num_tokens
            stats.hits += hit_tokens
            for block in cached:
                if not self._holders[block]:
                    del self._free[block]
                self._append(seq, block)
            seq.num_cached_tokens = hit_tokens
            seq.num_published_blocks = len(cached)
            if seq.num_preemptions == 0:
                seq.num_prefix_cached_tokens = hit_tokens
        for _ in range(self.blocks_needed(seq)):
            self._append(seq, self._take_free())

    # -- decode: the newest token (position num_tokens - 1) needs a slot --
    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) == 0 or len(self._free) >= 1

    def append_slot(self, seq: Sequence) -> None:
        if not self.try_append_slot(seq):
            raise RuntimeError(f"append_slot({seq.request_id}): no free block")

    def try_append_slot(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """can_append + append_slot in one call (the decode loop's, for every sequence every
        step): False, changing nothing, when a block is needed and none is free. num_tokens:
        the context to make room for (default: its token_ids; async scheduling's step ahead
        asks for one more, the token not read back yet)."""
        if -(-(num_tokens or len(seq.token_ids)) // self.block_size) <= len(seq.block_table):
            return True
        if not self._free:
            return False
        self.publish(seq)                     # the block the previous step filled
        self._append(seq, self._take_free())
        return True

    def undo_allocate(self, seq: Sequence) -> None:
        """Undo allocate() of a sequence whose tokens were never computed (a step launched ahead
        that was not launched after all): its blocks go back, and so do the prefix-cache counts
        its admission added."""
        if self.enable_caching:
            stats = self.prefix_cache_stats
            stats.requests -= 1
            stats.queries -= seq.num_tokens
            stats.hits -= seq.num_cached_tokens       # its cached prefix, all it holds computed
        self.free(seq)

    def drop_last_block(self, seq: Sequence) -> None:
        """Undo the try_append_slot that gave the sequence its last block (a step launched ahead
        that was not launched after all): the block, never written, goes back to the front of
        the free queue."""
        block = seq.block_table.pop()
        self._holders[block].remove(seq)
        self.tables[seq.block_table_row, len(seq.block_table)] = -1
        self._free[block] = None
        self._free.move_to_end(block, last=False)

    def free(self, seq: Sequence) -> None:
        """Let go of all of a sequence's blocks (finish, abort, preemption), publishing its full
        computed ones first; the blocks no one else holds go to the free queue."""
        self.publish(seq)
        for block in reversed(seq.block_table):
            holders = self._holders[block]
            if seq not in holders:
                raise RuntimeError(f"block {block} freed by {seq.request_id}, which does not own it")
            holders.remove(seq)
            if not holders:
                self._free[block] = None
                if self._hash[block] is None:
                    self._free.move_to_end(block, last=False)
        if seq.block_table_row is not None:
            self.tables[seq.block_table_row, :len(seq.block_table)] = -1
            self._free_rows.append(seq.block_table_row)
            seq.block_table_row = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_published_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _take_free(self) -> int:
        """The next block of the free queue, its published hash (if any) evicted."""
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:
            del self._published[h]
            self._hash[block] = None
            self.num_evictions += 1
        return block

    def _append(self, seq: Sequence, block: int) -> None:
        self._holders[block].add(seq)
        if seq.block_table_row is None:
            if not self._free_rows:
                self._grow(rows=2 * self.tables.shape[0])
            seq.block_table_row = self._free_rows.pop()
        if len(seq.block_table) == self.tables.shape[1]:
            self._grow(cols=2 * self.tables.shape[1])
        self.tables[seq.block_table_row, len(seq.block_table)] = block
        seq.block_table.append(block)

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old = self.tables
        self.tables = np.full((rows or old.shape[0], cols or old.shape[1]), -1, np.int32)
        self.tables[:old.shape[0], :old.shape[1]] = old
        self._free_rows += range(old.shape[0], self.tables.shape[0])
