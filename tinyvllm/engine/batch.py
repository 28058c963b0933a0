"""ForwardBatch: the one input format of a model forward pass, shared by the numpy reference
backend and the CUDA backend.

A batch holds S sequences, flattened into T new tokens. Sequence i contributes the tokens
[query_start[i], query_start[i+1]) of the flat arrays; they sit at the *end* of its context, so
its first new token has position context_lens[i] - q_len_i. A prefill batch has q_len = prompt
length (or the uncached part of it); a decode batch has q_len = 1 for every sequence.

The paged KV cache (per layer, K and V each):  [num_blocks, block_size, kv_heads, head_dim]

    block_tables[i] = [7, 2, 9, ...]      logical block j of sequence i lives in physical block
                                           block_tables[i, j]; unused entries are -1
    token at position p of sequence i  ->  slot = block_tables[i, p // block_size] * block_size
                                                  + p % block_size
    slot_mapping[t]                        the slot each new token's K and V are written to

Attention for new token t of sequence i reads positions 0 .. position[t] (causal), i.e. the
cached prefix and the new tokens up to itself, all through the block table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ForwardBatch:
    token_ids: np.ndarray      # int32 [T]
    positions: np.ndarray      # int32 [T]
    slot_mapping: np.ndarray   # int32 [T]
    query_start: np.ndarray    # int32 [S + 1], query_start[0] = 0, query_start[S] = T
    context_lens: np.ndarray   # int32 [S], cached + new tokens
    block_tables: np.ndarray   # int32 [S, max_blocks], -1 padded
    is_prefill: bool

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token_indices(self) -> np.ndarray:
        """Flat index of each sequence's last new token: the rows whose logits are needed."""
        return self.query_start[1:] - 1

    @classmethod
    def build(cls, new_tokens: list[list[int]], context_lens: list[int],
              block_tables: list[list[int]], block_size: int, is_prefill: bool) -> ForwardBatch:
        """Flatten per-sequence new tokens (at the end of each context) into a batch."""
        q_lens = [len(t) for t in new_tokens]
        query_start = np.zeros(len(q_lens) + 1, np.int32)
        np.cumsum(q_lens, out=query_start[1:])
        positions = np.concatenate([np.arange(c - q, c, dtype=np.int32)
                                    for q, c in zip(q_lens, context_lens)]) if q_lens else np.zeros(0, np.int32)
        width = max((len(b) for b in block_tables), default=0)
        tables = np.full((len(block_tables), max(width, 1)), -1, np.int32)
        for i, b in enumerate(block_tables):
            tables[i, :len(b)] = b
        seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        return cls(
            token_ids=np.asarray([t for ts in new_tokens for t in ts], np.int32),
            positions=positions,
            slot_mapping=slots.astype(np.int32),
            query_start=query_start,
            context_lens=np.asarray(context_lens, np.int32),
            block_tables=tables,
            is_prefill=is_prefill,
        )

    @classmethod
    def build_decode(cls, token_ids: list[int], context_lens: list[int], block_tables: np.ndarray,
                     block_size: int) -> ForwardBatch:
        """A decode batch (one new token per sequence, at position context_len - 1) from
        ready-made -1 padded block tables: what build() gives, in a few vectorized steps."""
        context_lens = np.asarray(context_lens, np.int32)
        positions = context_lens - 1
        rows = np.arange(len(context_lens))
        slots = block_tables[rows, positions // block_size] * block_size + positions % block_size
        return cls(
            token_ids=np.asarray(token_ids, np.int32),
            positions=positions,
            slot_mapping=slots.astype(np.int32),
            query_start=np.arange(len(context_lens) + 1, dtype=np.int32),
            context_lens=context_lens,
            block_tables=block_tables,
            is_prefill=False,
        )


GREEDY_BELOW = 1e-5                 # SamplingBatch maps temperatures below this to 0 (greedy)


@dataclass
class SamplingBatch:
    """Per-sequence sampling inputs of one step, in the dtypes the CUDA kernel reads."""
    temperature: np.ndarray   # float32 [S]; 0 = greedy
    top_k: np.ndarray         # int32 [S];   <= 0 or >= vocab: off
    top_p: np.ndarray         # float32 [S]; 1 = off
    seed: np.ndarray          # uint64 [S]
    step: np.ndarray          # int32 [S];   tokens this request has generated so far

    @classmethod
    def build(cls, temperature, top_k, top_p, seed, step) -> SamplingBatch:
        t = np.asarray(temperature, np.float32)
        return cls(temperature=np.where(t < GREEDY_BELOW, np.float32(0), t).astype(np.float32),
                   top_k=np.asarray(top_k, np.int32), top_p=np.asarray(top_p, np.float32),
                   seed=np.asarray(seed, np.uint64), step=np.asarray(step, np.int32))

    @classmethod
    def greedy(cls, num_seqs: int) -> SamplingBatch:
        return cls.build([0.0] * num_seqs, [-1] * num_seqs, [1.0] * num_seqs,
                         [0] * num_seqs, [0] * num_seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.temperature)

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature <= 0))
