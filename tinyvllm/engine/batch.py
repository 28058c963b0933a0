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
MAX_LOGPROBS = 20                   # top log-probs a row may ask for (vLLM's default max_logprobs)
EDIT_WORDS = 8                      # 4-byte words per packed LogitEdits entry (sampling.cu's LogitEdit)


@dataclass
class LogitEdits:
    """The step's logit processing, as sparse in-place edits: one entry per (row, token) that
    some row's logit_bias, min_tokens or penalties touch, nothing for any other logit. Each
    entry applies, in vLLM's order (reference/sampling.py's docstring):

        x = logits[row, token]              (left alone if NaN or +inf: a broken row stays broken)
        if forbid:  x = -inf                min_tokens not reached: EOS / stop_token_ids banned
        x = x + bias                        logit_bias
        x = x / rep if x > 0 else x * rep   repetition_penalty (rep = 1 for unseen tokens)
        x = x - freq                        freq = frequency_penalty * output count (fp32)
        x = x - pres                        pres = presence_penalty if output count > 0 else 0

    All values are fp32, computed once on the host, so the numpy twin and the kernel do the
    same five IEEE operations. Entries whose token is outside the vocabulary are skipped."""
    row: np.ndarray       # int32 [E]
    token: np.ndarray     # int32 [E]
    forbid: np.ndarray    # bool [E]
    bias: np.ndarray      # float32 [E]
    rep: np.ndarray       # float32 [E]
    freq: np.ndarray      # float32 [E]
    pres: np.ndarray      # float32 [E]

    @property
    def num_entries(self) -> int:
        return len(self.row)

    def packed(self) -> np.ndarray:
        """int32 [E, EDIT_WORDS]: the kernel's struct LogitEdit, one upload."""
        out = np.zeros((self.num_entries, EDIT_WORDS), np.int32)
        out[:, 0], out[:, 1], out[:, 2] = self.row, self.token, self.forbid
        f = out.view(np.float32)
        f[:, 3], f[:, 4], f[:, 5], f[:, 6] = self.bias, self.rep, self.freq, self.pres
        return out

    @classmethod
    def concat(cls, parts: list[tuple]) -> LogitEdits | None:
        if not parts:
            return None
        cols = list(zip(*parts))
        return cls(*(np.concatenate(c).astype(d) for c, d in zip(
            cols, (np.int32, np.int32, bool, np.float32, np.float32, np.float32, np.float32))))


def row_edits(row: int, seq, eos_token_ids=()) -> tuple | None:
    """One sequence's LogitEdits columns for this step, or None when it has nothing to edit.
    Cost: O(distinct tokens it has seen) of numpy when it uses a penalty, O(new tokens) of
    Python (Sequence.token_counts), O(len(logit_bias) + stop ids) otherwise."""
    p = seq.params
    rep = float(getattr(p, "repetition_penalty", 1.0))
    pres = float(getattr(p, "presence_penalty", 0.0))
    freq = float(getattr(p, "frequency_penalty", 0.0))
    bias = getattr(p, "logit_bias", None) or {}
    min_tokens = getattr(p, "min_tokens", 0) or 0
    forbidden: set[int] = set()
    if seq.num_output_tokens < min_tokens:
        forbidden = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            forbidden.update(eos_token_ids)
    penalised = rep != 1.0 or pres != 0.0 or freq != 0.0
    if not (penalised or bias or forbidden):
        return None
    if penalised:
        c = seq.token_counts()
        counts = c.output_counts
        # with rep == 1 a token only the prompt holds is untouched: leave it out
        keep = slice(None) if rep != 1.0 else counts > 0
        tokens, counts = c.ids[keep], counts[keep]
        slot_of = {t: i for i, t in enumerate(tokens.tolist())} if rep == 1.0 else None
        lookup = (lambda t: slot_of.get(t)) if slot_of is not None else c.slot
    else:
        tokens, counts = np.zeros(0, np.int32), np.zeros(0, np.int32)
        lookup = lambda t: None  # noqa: E731
    n = len(tokens)
    extra = sorted(t for t in set(bias) | forbidden if lookup(t) is None)
    tokens = np.concatenate([tokens, np.asarray(extra, np.int32)])
    e = len(tokens)
    counts = np.concatenate([counts, np.zeros(len(extra), np.int32)])
    rep_col = np.ones(e, np.float32)
    rep_col[:n] = np.float32(rep)                     # every counted token has been seen
    freq_col = np.float32(freq) * counts.astype(np.float32)
    pres_col = np.where(counts > 0, np.float32(pres), np.float32(0)).astype(np.float32)
    bias_col = np.zeros(e, np.float32)
    forbid_col = np.zeros(e, bool)
    position = {t: n + i for i, t in enumerate(extra)}
    for t, b in bias.items():
        i = lookup(t)
        bias_col[position[t] if i is None else i] = np.float32(b)
    for t in forbidden:
        i = lookup(t)
        forbid_col[position[t] if i is None else i] = True
    return (np.full(e, row, np.int32), tokens, forbid_col, bias_col, rep_col, freq_col, pres_col)


@dataclass
class StepLogprobs:
    """What the runner returns besides the sampled ids when some row asked for logprobs:
    vLLM's default "raw" logprobs, log_softmax of the model's logits before any processing.
    Row j is for batch row rows[j]; top_* hold k = the most any of them asked for, best first
    (ties: lower id first), so a row asking for n reads the first n columns."""
    rows: np.ndarray              # int32 [R]
    sampled_logprob: np.ndarray   # float32 [R]
    sampled_rank: np.ndarray      # int32 [R]: 1 + number of other tokens with logit >= the sampled one's
    top_ids: np.ndarray           # int32 [R, k]
    top_logprobs: np.ndarray      # float32 [R, k]


@dataclass
class SamplingBatch:
    """Per-sequence sampling inputs of one step, in the dtypes the CUDA kernel reads."""
    temperature: np.ndarray   # float32 [S]; 0 = greedy
    top_k: np.ndarray         # int32 [S];   <= 0 or >= vocab: off
    top_p: np.ndarray         # float32 [S]; 1 = off
    seed: np.ndarray          # uint64 [S]
    step: np.ndarray          # int32 [S];   tokens this request has generated so far
    min_p: np.ndarray | None = None       # float32 [S]; 0 = off (None: all off)
    edits: LogitEdits | None = None       # sparse logit processing; None: nothing to edit
    logprobs: np.ndarray | None = None    # int32 [S]; top log-probs wanted, -1 = none (None: none)

    def __post_init__(self):
        if self.min_p is None:
            self.min_p = np.zeros(len(self.temperature), np.float32)

    @classmethod
    def build(cls, temperature, top_k, top_p, seed, step, min_p=None, edits=None,
              logprobs=None) -> SamplingBatch:
        t = np.asarray(temperature, np.float32)
        lp = None
        if logprobs is not None:
            lp = np.asarray([-1 if v is None else v for v in logprobs], np.int32)
            if not np.any(lp >= 0):
                lp = None
        return cls(temperature=np.where(t < GREEDY_BELOW, np.float32(0), t).astype(np.float32),
                   top_k=np.asarray(top_k, np.int32), top_p=np.asarray(top_p, np.float32),
                   seed=np.asarray(seed, np.uint64), step=np.asarray(step, np.int32),
                   min_p=None if min_p is None else np.asarray(min_p, np.float32),
                   edits=edits, logprobs=lp)

    @classmethod
    def from_sequences(cls, seqs, eos_token_ids=()) -> SamplingBatch:
        """The step's sampling inputs for these sequences (ScheduledBatch.sampling_batch).
        Rows that use no penalty, bias or min_tokens add nothing to `edits`; a batch where
        none does has edits None, and then the runner launches exactly the plain sampler."""
        p = [s.params for s in seqs]
        parts = [r for i, s in enumerate(seqs) if (r := row_edits(i, s, eos_token_ids)) is not None]
        return cls.build([x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p],
                         [s.seed for s in seqs], [len(s.token_ids) - s.num_prompt_tokens for s in seqs],
                         min_p=[getattr(x, "min_p", 0.0) for x in p], edits=LogitEdits.concat(parts),
                         logprobs=[getattr(x, "logprobs", None) for x in p])

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

    @property
    def logprob_rows(self) -> np.ndarray:
        """int32: the rows that asked for logprobs (empty when none did)."""
        if self.logprobs is None:
            return np.zeros(0, np.int32)
        return np.flatnonzero(self.logprobs >= 0).astype(np.int32)

    @property
    def logprob_k(self) -> int:
        """The most top log-probs any row asked for (0 when none asked, or all asked for 0)."""
        return 0 if self.logprobs is None else max(0, int(self.logprobs.max()))
