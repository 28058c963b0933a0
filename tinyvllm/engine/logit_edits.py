"""The sampler's logit processing (SamplingParams' repetition / frequency / presence penalties,
logit_bias and min_tokens) as sparse in-place edits of the logits: LogitEdits is one step's, in
the layout the kernels of sampling.cu read; SequenceEdits keeps one sequence's entries from step to
step; step_edits gathers a batch's. reference/sampling.py applies them in numpy, sampling.cu's
apply_logit_edits on the GPU.
"""
from __future__ import annotations

import numpy as np

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
    return NO_EDITS if p.min_p or p.logprobs is not None or seq.constraint is not None else PLAIN


def sampler_state(seq, eos_token_ids=()):
    """seq.sampler_state, made on first use."""
    if seq.sampler_state is None:
        seq.sampler_state = (SequenceEdits(seq, eos_token_ids) if SequenceEdits.wanted(seq)
                             else _state_without_edits(seq))
    return seq.sampler_state


def step_edits(seqs, eos_token_ids=()) -> LogitEdits | None:
    """The step's LogitEdits: each sequence's kept entries (SequenceEdits, made on first use),
    copied once into the batch with its row; None when no sequence has any."""
    blocks, rows = [], []
    for i, seq in enumerate(seqs):
        state = sampler_state(seq, eos_token_ids)
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
