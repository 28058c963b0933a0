"""BlockManager: which physical KV-cache blocks each sequence owns.

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
Invariants:
    len(block_table) == ceil(tokens that have or are about to have K/V / block_size)
    every block id is either in the free list or in exactly one block table
A decode step writes K/V for position num_tokens - 1; when that position starts a new block
(num_tokens - 1 is a multiple of block_size) the sequence needs one more block first.

Each block table is also copied into a row of `tables` (int32, -1 padded; the row number is
seq.block_table_row while the sequence holds blocks), so that a decode batch's block tables are
one numpy gather, `tables[rows, :width]`, rather than a Python loop over the sequences.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from tinyvllm.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}      # block id -> request id, to catch double frees
        self.tables = np.full((16, 16), -1, np.int32)   # grows by doubling as needed
        self._free_rows = list(range(16))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    # -- prefill: blocks for every token the sequence has (prompt, or prompt + generated when a
    #    preempted sequence is recomputed) --
    def blocks_needed(self, seq: Sequence) -> int:
        return max(0, blocks_for(seq.num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        needed = self.blocks_needed(seq)
        if needed > len(self._free):
            raise RuntimeError(f"allocate({seq.request_id}): {needed} blocks needed, "
                               f"{len(self._free)} free")
        for _ in range(needed):
            self._take(seq)

    # -- decode: the newest token (position num_tokens - 1) needs a slot --
    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) == 0 or len(self._free) >= 1

    def append_slot(self, seq: Sequence) -> None:
        if self.blocks_needed(seq):
            if not self._free:
                raise RuntimeError(f"append_slot({seq.request_id}): no free block")
            self._take(seq)

    def try_append_slot(self, seq: Sequence) -> bool:
        """can_append + append_slot in one call (the decode loop's, for every sequence every
        step): False, changing nothing, when a block is needed and none is free."""
        if -(-len(seq.token_ids) // self.block_size) <= len(seq.block_table):
            return True
        if not self._free:
            return False
        self._take(seq)
        return True

    def free(self, seq: Sequence) -> None:
        """Give back all of a sequence's blocks (finish, abort, preemption)."""
        for block in seq.block_table:
            if self._owner.pop(block, None) != seq.request_id:
                raise RuntimeError(f"block {block} freed by {seq.request_id}, which does not own it")
            self._free.append(block)
        if seq.block_table_row is not None:
            self.tables[seq.block_table_row, :len(seq.block_table)] = -1
            self._free_rows.append(seq.block_table_row)
            seq.block_table_row = None
        seq.block_table = []
        seq.num_cached_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _take(self, seq: Sequence) -> None:
        block = self._free.popleft()
        self._owner[block] = seq.request_id
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
