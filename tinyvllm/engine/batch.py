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

Fed tokens (async scheduling, engine/llm_engine.py): a decode step may be launched before the
step before it has been read back. Its token ids are then not known on the host yet:
fed_rows[t] = r >= 0 says token t is row r of the previous step's sampled ids, which the
device reads where the previous step's sampler left them; -1 (or fed_rows None) says token t
is token_ids[t].
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tinyvllm.structured.mask import TokenMask, step_token_mask


@dataclass
class ForwardBatch:
    token_ids: np.ndarray      # int32 [T]
    positions: np.ndarray      # int32 [T]
    slot_mapping: np.ndarray   # int32 [T]
    query_start: np.ndarray    # int32 [S + 1], query_start[0] = 0, query_start[S] = T
    context_lens: np.ndarray   # int32 [S], cached + new tokens
    block_tables: np.ndarray   # int32 [S, max_blocks], -1 padded
    is_prefill: bool
    fed_rows: np.ndarray | None = None   # int32 [T]: see "Fed tokens" above; None: none fed

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def with_fed_ids(self, previous_ids: np.ndarray) -> ForwardBatch:
        """This batch with its fed tokens resolved from the previous step's sampled ids (what
        the device does in the embedding gather; used where the ids are known on the host)."""
        if self.fed_rows is None:
            return self
        fed = self.fed_rows >= 0
        ids = self.token_ids.copy()
        ids[fed] = np.asarray(previous_ids, np.int32)[self.fed_rows[fed]]
        return dataclasses.replace(self, token_ids=ids, fed_rows=None)

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
    same five IEEE operations. Entries whose token is outside the vocabulary are skipped.
    Stored as the kernel reads it: int32 words [E, EDIT_WORDS] = row, token, forbid, bias, rep,
    freq, pres (the float words as their bits), and the output count (unused by the kernel)."""

    def __init__(self, words: np.ndarray):
        self.words = words
        self._f = words.view(np.float32)

    @classmethod
    def from_columns(cls, row, token, forbid=None, bias=None, rep=None, freq=None, pres=None) -> LogitEdits:
        n = len(token)
        words = np.zeros((n, EDIT_WORDS), np.int32)
        f = words.view(np.float32)
        words[:, 0], words[:, 1] = row, token
        words[:, 2] = 0 if forbid is None else forbid
        f[:, 3] = 0.0 if bias is None else bias
        f[:, 4] = 1.0 if rep is None else rep
        f[:, 5] = 0.0 if freq is None else freq
        f[:, 6] = 0.0 if pres is None else pres
        return cls(words)

    @property
    def num_entries(self) -> int:
        return len(self.words)

    row = property(lambda self: self.words[:, 0])
    token = property(lambda self: self.words[:, 1])
    forbid = property(lambda self: self.words[:, 2] != 0)
    bias = property(lambda self: self._f[:, 3])
    rep = property(lambda self: self._f[:, 4])
    freq = property(lambda self: self._f[:, 5])
    pres = property(lambda self: self._f[:, 6])

    def packed(self) -> np.ndarray:
        """int32 [E, EDIT_WORDS]: the kernel's struct LogitEdit, one upload."""
        return self.words


class SequenceEdits:
    """One sequence's LogitEdits entries, kept on the Sequence (Sequence.sampler_state) from
    step to step and brought up to date with the tokens generated since: a step costs O(new
    tokens) of Python plus one copy of the entries into the batch. Made on first use from the
    request's parameters:
      repetition_penalty != 1: an entry per distinct prompt token (rep), and one per distinct
                               generated token as it appears (with rep = 1 only generated
                               tokens can change, so the prompt's are left out)
      presence / frequency:    an entry per distinct generated token (freq, pres from its count)
      logit_bias:              an entry per biased token (bias)
      min_tokens:              an entry per EOS / stop token id (forbid), cleared once reached
    One entry per token whatever the reasons, so that no two threads of the kernel edit one logit."""

    def __init__(self, seq, eos_token_ids=()):
        p = seq.params
        self.rep = np.float32(getattr(p, "repetition_penalty", 1.0))
        self.freq = np.float32(getattr(p, "frequency_penalty", 0.0))
        self.pres = np.float32(getattr(p, "presence_penalty", 0.0))
        self.counts_output = self.rep != 1 or self.freq != 0 or self.pres != 0
        self.biased = bool(getattr(p, "logit_bias", None))
        self.min_tokens = getattr(p, "min_tokens", 0) or 0
        self._slot: dict[int, int] = {}
        self._words = np.zeros((16, EDIT_WORDS), np.int32)
        self.size = 0
        self.num_output_counted = 0
        if self.rep != 1:
            for t in np.unique(np.asarray(seq.prompt_token_ids, np.int64)).tolist():
                i = self._entry(t)                    # first: it may grow the entries
                self._f[i, 4] = self.rep
        for t, b in (getattr(p, "logit_bias", None) or {}).items():
            i = self._entry(int(t))
            self._f[i, 3] = np.float32(b)
        self._forbid_slots: list[int] = []
        if seq.num_output_tokens < self.min_tokens:
            banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids))
            self._forbid_slots = [self._entry(int(t)) for t in sorted(banned)]
            self._words[self._forbid_slots, 2] = 1

    @classmethod
    def wanted(cls, seq) -> bool:
        """Whether this sequence's parameters need any entry now or later."""
        p = seq.params
        return (getattr(p, "repetition_penalty", 1.0) != 1 or getattr(p, "frequency_penalty", 0.0) != 0
                or getattr(p, "presence_penalty", 0.0) != 0 or bool(getattr(p, "logit_bias", None))
                or seq.num_output_tokens < (getattr(p, "min_tokens", 0) or 0))

    @property
    def _f(self) -> np.ndarray:
        return self._words.view(np.float32)

    def _entry(self, token: int) -> int:
        i = self._slot.get(token)
        if i is None:
            i = self.size
            if i == len(self._words):
                self._words = np.concatenate([self._words, np.zeros_like(self._words)])
            self._words[i, 1] = token
            self._f[i, 4] = 1.0
            self._slot[token] = i
            self.size += 1
        return i

    def sync(self, seq) -> None:
        """Absorb the tokens generated since the last call (token_ids only grows: a preempted
        sequence keeps its generated tokens), and lift the ban once min_tokens is reached."""
        start = seq.num_prompt_tokens + self.num_output_counted
        new = seq.token_ids[start:]
        if new and self.counts_output:
            for t in new:
                i = self._entry(t)
                w = self._words                          # _entry may have grown it
                w[i, 7] += 1
                f = w.view(np.float32)
                f[i, 4] = self.rep                       # seen now
                f[i, 5] = self.freq * np.float32(w[i, 7])
                f[i, 6] = self.pres
        self.num_output_counted += len(new)
        if self._forbid_slots and seq.num_output_tokens >= self.min_tokens:
            self._words[self._forbid_slots, 2] = 0
            self._forbid_slots = []

    @property
    def entries(self) -> np.ndarray:
        return self._words[:self.size]

    @property
    def is_noop(self) -> bool:
        """Nothing left to do now or later (a min_tokens-only request past its minimum)."""
        return not (self.counts_output or self.biased or self._forbid_slots)

    def output_count(self, token: int) -> int:
        i = self._slot.get(token)
        return 0 if i is None else int(self._words[i, 7])


# Sequence.sampler_state: None (not looked at yet), PLAIN (no edits, min_p or logprobs, now or
# later: the step's fast path), NO_EDITS (min_p or logprobs only), or its SequenceEdits.
PLAIN, NO_EDITS = "plain", "no edits"


def _state_without_edits(seq) -> str:
    p = seq.params
    # a constrained row (structured outputs) is never PLAIN: its mask follows from its last token
    return NO_EDITS if p.min_p or p.logprobs is not None or getattr(seq, "constraint", None) is not None else PLAIN


def step_edits(seqs, eos_token_ids=()) -> LogitEdits | None:
    """The step's LogitEdits: each sequence's kept entries (SequenceEdits, made on first use),
    copied once into the batch with its row; None when no sequence has any."""
    blocks, rows = [], []
    for i, seq in enumerate(seqs):
        state = seq.sampler_state
        if state is None:
            state = seq.sampler_state = (SequenceEdits(seq, eos_token_ids) if SequenceEdits.wanted(seq)
                                         else _state_without_edits(seq))
        if state is PLAIN or state is NO_EDITS:
            continue
        state.sync(seq)
        if state.is_noop:
            seq.sampler_state = _state_without_edits(seq)
            continue
        if state.size:
            blocks.append(state.entries)
            rows.append(i)
    if not blocks:
        return None
    words = np.concatenate(blocks)
    words[:, 0] = np.repeat(np.asarray(rows, np.int32), [len(b) for b in blocks])
    return LogitEdits(words)


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
    token_mask: TokenMask | None = None   # constrained rows' allowed tokens (structured/mask.py)

    def __post_init__(self):
        if self.min_p is None:
            self.min_p = np.zeros(len(self.temperature), np.float32)

    @classmethod
    def build(cls, temperature, top_k, top_p, seed, step, min_p=None, edits=None,
              logprobs=None, token_mask=None) -> SamplingBatch:
        t = np.asarray(temperature, np.float32)
        lp = None
        if logprobs is not None:
            lp = np.asarray([-1 if v is None else v for v in logprobs], np.int32)
            if not np.any(lp >= 0):
                lp = None
        return cls(temperature=np.where(t < GREEDY_BELOW, np.float32(0), t).astype(np.float32),
                   top_k=np.asarray(top_k, np.int32), top_p=np.asarray(top_p, np.float32),
                   seed=np.asarray(seed, np.uint64), step=np.asarray(step, np.int32),
                   # clamped to [0, 1] (NaN -> 0): above 1 no token would survive the draw
                   min_p=None if min_p is None else np.clip(np.nan_to_num(np.asarray(min_p, np.float32)), 0, 1),
                   edits=edits, logprobs=lp, token_mask=token_mask)

    @classmethod
    def from_sequences(cls, seqs, eos_token_ids=(), tokens_ahead: int = 0) -> SamplingBatch:
        """The step's sampling inputs for these sequences (ScheduledBatch.sampling_batch).
        Rows that use no penalty, bias or min_tokens add nothing to `edits`; a batch where
        none does has edits None, and then the runner launches exactly the plain sampler.
        tokens_ahead: tokens each sequence will have generated before this step that are not
        in its token_ids yet (async scheduling's step launched ahead; plain rows only)."""
        p = [s.params for s in seqs]
        states = [s.sampler_state for s in seqs]
        if tokens_ahead and states.count(PLAIN) != len(states):
            raise ValueError("only plain-sampling rows can be sampled ahead of their last token")
        if states.count(PLAIN) == len(states):        # the common step: as before issue 11
            # built here with one numpy call per array: this runs every step, and at batch 1
            # build()'s generic conversions were a third of the engine's host time per step
            return cls(temperature=np.array([0.0 if x.temperature < GREEDY_BELOW else x.temperature for x in p],
                                            np.float32),
                       top_k=np.array([x.top_k for x in p], np.int32),
                       top_p=np.array([x.top_p for x in p], np.float32),
                       seed=np.array([s.seed for s in seqs], np.uint64),
                       step=np.array([len(s.token_ids) - s.num_prompt_tokens + tokens_ahead for s in seqs],
                                     np.int32),
                       min_p=np.zeros(len(p), np.float32))
        min_p = [x.min_p for x in p]
        logprobs = [x.logprobs for x in p]
        return cls.build([x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p],
                         [s.seed for s in seqs], [len(s.token_ids) - s.num_prompt_tokens for s in seqs],
                         min_p=min_p if any(min_p) else None, edits=step_edits(seqs, eos_token_ids),
                         logprobs=None if logprobs.count(None) == len(logprobs) else logprobs,
                         token_mask=step_token_mask(seqs))

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
