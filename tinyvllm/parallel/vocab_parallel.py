"""The vocabulary-parallel LM head's sampling: each rank holds the logits of its own ids only.

Greedy steps exchange one 64-bit key per row and rank instead of the logits: each rank's key is
reference/sampling.py::head_argmax_keys of its shard (the row's max as an ordered integer in the
high word, 2^32 - 1 - id in the low word), with the rank's first id added to the index, so the
largest key over all ranks names the full row's max and, among equal maxima, its lowest id —
np.argmax's answer on the gathered row. NaN keys are the largest, so a NaN anywhere wins and marks
the row broken, as the unsharded sampler does (NON_FINITE for NaN, +inf, or no finite logit).

Every other step (temperature, logit edits, a token mask, logprobs) needs the full distribution
of its rows: those gather the rows' logits in rank order (gather_vocab), which is the full row.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.engine.batch import SamplingBatch
from tinyvllm.reference.sampling import NON_FINITE, head_argmax_keys

LOW_WORD = np.uint64(0xFFFFFFFF)
PLUS_INF_KEY = 0xFF800000           # reference/sampling.py::ordered_keys of +inf
MINUS_INF_KEY = 0x007FFFFF          # ... of -inf


def shard_argmax_keys(shard_logits: np.ndarray, vocab_start: int) -> np.ndarray:
    """uint64 [rows]: the greedy keys of a rank's logits [rows, shard], naming full-vocabulary ids
    (the low word 2^32 - 1 - id never borrows: vocab_start + local id < 2^32)."""
    return head_argmax_keys(shard_logits) - np.uint64(vocab_start)


def ids_from_keys(keys_per_rank: list[np.ndarray]) -> np.ndarray:
    """The all-reduce (max) of every rank's keys, decoded -> int32 [rows]: the argmax id, or
    NON_FINITE where the row's max is NaN, +inf or -inf."""
    best = np.maximum.reduce([np.asarray(k, np.uint64) for k in keys_per_rank])
    ids = (LOW_WORD - (best & LOW_WORD)).astype(np.int64)
    high = best >> np.uint64(32)
    broken = (high >= PLUS_INF_KEY) | (high <= MINUS_INF_KEY)
    return np.where(broken, NON_FINITE, ids).astype(np.int32)


def argmax_only(sampling: SamplingBatch) -> bool:
    """A step whose every id is its row's argmax: greedy, nothing edited, masked or asked of the
    distribution (the steps that exchange keys, not logits)."""
    return (sampling.all_greedy and sampling.edits is None and sampling.token_mask is None
            and sampling.logprobs is None)


def gather_vocab(shard_logits: list[np.ndarray]) -> np.ndarray:
    """The full logits [rows, vocab]: every rank's shard side by side, in rank order."""
    return np.ascontiguousarray(np.concatenate(shard_logits, axis=-1), np.float32)
