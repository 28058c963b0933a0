"""A step as the GPU forward sees it: StepShape, the only per-step launch parameters, and the
input views of the arena's banks the kernels read (TokenInputs, BankInputs). Everything else a
step needs is in the arena, written before the launch (gpu/input_banks.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.gpu.arena import TOKEN_INPUTS, Arena


@dataclass(frozen=True)
class StepShape:
    """What the host passes to the kernels besides the arena's contents: the only per-step
    launch parameters. A decode step's shape depends on num_seqs alone, so one captured CUDA
    graph per batch size and input bank serves every decode step of that size."""
    num_tokens: int
    num_seqs: int
    is_prefill: bool
    max_query_len: int = 1     # a prefill-kind step: the longest row past its decode_rows
    bank: int = 0              # the arena input bank this step's inputs were uploaded into
    decode_rows: int = 0       # a prefill-kind step: its leading one-token rows (a mixed step's
                               # decode rows), whose attention is attention_decode's
    table_width: int = 0       # the block tables' row stride this step (with decode_rows)

    @classmethod
    def of(cls, batch, *, num_tokens: int | None = None, num_seqs: int | None = None, bank: int = 0) -> StepShape:
        """A ForwardBatch's shape. In a prefill-kind step the leading rows of one token (the
        scheduler puts a mixed step's decode rows first) are decode_rows, and max_query_len is
        that of the rows after them."""
        decode_rows = batch.leading_decode_rows
        rest = np.diff(batch.query_start)[decode_rows:]
        return cls(num_tokens=batch.num_tokens if num_tokens is None else num_tokens,
                   num_seqs=batch.num_seqs if num_seqs is None else num_seqs, is_prefill=batch.is_prefill,
                   max_query_len=int(rest.max()) if len(rest) else 1, bank=bank, decode_rows=decode_rows,
                   table_width=int(batch.block_tables.shape[1]))


@dataclass(frozen=True)
class TokenInputs:
    """Device pointers of one step's per-token inputs (arena.TOKEN_INPUTS, in its order)."""
    token_ids: int
    positions: int
    slot_mapping: int
    fed_rows: int


@dataclass(frozen=True)
class BankInputs:
    """The input views the forward pass reads, in one of the arena's input banks."""
    tokens: dict[bool, TokenInputs]     # by is_prefill: the prefill arrays or the decode_ ones
    query_start: int
    context_lens: int
    last_token_idx: int
    block_tables: int
    block_table_width: int
    cascade_prefix_len: int     # a decode step's shared prefix in positions (0: none)

    @classmethod
    def of(cls, arena: Arena, bank: int) -> BankInputs:
        v = lambda name: arena.view(name, bank)  # noqa: E731
        return cls({prefill: TokenInputs(*(v(prefix + name) for name in TOKEN_INPUTS))
                    for prefill, prefix in ((True, ""), (False, "decode_"))},
                   v("query_start"), v("context_lens"), v("last_token_idx"), v("block_tables"),
                   v("block_table_width"), v("cascade_prefix_len"))
