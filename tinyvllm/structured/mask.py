"""The step's token mask: which tokens each constrained row may sample.

    TokenMask.rows  int32 [R]      the batch rows with a constraint that sample this step
    TokenMask.bits  int32 [R, W]   W = ceil(vocab / 32); bit t % 32 of word t // 32 of row j
                                   is set when token t is allowed in batch row rows[j]

Built on the host before each step that samples a constrained row (SamplingBatch.token_mask,
engine/batch.py), from each row's matcher (structured/grammar.py), all rows at once on
llguidance's thread pool; None when no row of the step is constrained, and then nothing of this
runs and the runner launches nothing for it. Both samplers set every refused token's logit to
-inf before anything else (reference/sampling.py's apply_token_mask, its CUDA twin
cuda/token_mask.cu), so the sampling rule, whatever it is, can only pick an allowed token.

A row whose prompt is not complete after this step (a prefill chunk) samples nothing and gets
no mask.

A step launched ahead (async scheduling, engine/step_ahead.py) is launched before its rows'
last tokens are known, so its mask cannot be built yet: its SamplingBatch.token_mask is a
PendingTokenMask, which computes the mask when resolved — by the engine once the step before is
applied (the matchers then hold every token), or by the runner just before it samples, whichever
comes first. The runner launches the forward meanwhile: the host's mask work runs beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_executor = None


@dataclass
class TokenMask:
    rows: np.ndarray       # int32 [R]
    bits: np.ndarray       # int32 [R, W]

    @property
    def num_rows(self) -> int:
        return len(self.rows)


def step_token_mask(seqs) -> TokenMask | None:
    """The mask of a step's batch rows (its sequences, in row order); None without a
    constrained row that samples."""
    return _mask_of_rows(seqs, [i for i, s in enumerate(seqs) if getattr(s, "constraint", None) is not None
                                and s.num_cached_tokens + s.num_scheduled_tokens >= len(s.token_ids)])


class PendingTokenMask:
    """The token mask of a decode step launched before its rows' last tokens were applied (the
    module docstring). resolve() computes it once, from the matchers as they are then, for the
    constrained rows still running: a row that finished meanwhile (stop, grammar complete,
    abort) has its token thrown away by the engine, so it is left unmasked rather than masked by
    a matcher that has nothing left to allow. Callbacks given to on_resolved run right after."""

    def __init__(self, seqs):
        self.seqs = list(seqs)                        # the launched step's rows, in order
        self._mask: TokenMask | None = None
        self._callbacks: list | None = []             # None once resolved

    @property
    def resolved(self) -> bool:
        return self._callbacks is None

    def resolve(self) -> TokenMask | None:
        if self._callbacks is not None:
            callbacks, self._callbacks = self._callbacks, None
            self._mask = _mask_of_rows(self.seqs, [i for i, s in enumerate(self.seqs)
                                                   if s.constraint is not None and not s.status.is_finished])
            for callback in callbacks:
                callback(self._mask)
        return self._mask

    def on_resolved(self, callback) -> None:
        """callback(mask) once the mask is computed (at once if it is already)."""
        if self._callbacks is None:
            callback(self._mask)
        else:
            self._callbacks.append(callback)


def resolved_token_mask(token_mask) -> TokenMask | None:
    """A SamplingBatch.token_mask as the sampler needs it: a PendingTokenMask resolved now."""
    return token_mask.resolve() if isinstance(token_mask, PendingTokenMask) else token_mask


def _mask_of_rows(seqs, rows: list[int]) -> TokenMask | None:
    """The mask of these batch rows (constrained ones), all at once on llguidance's threads."""
    if not rows:
        return None
    from llguidance.numpy import fill_next_token_bitmask_par
    global _executor
    if _executor is None:
        import llguidance
        _executor = llguidance.LLExecutor()
    bits = np.zeros((len(rows), seqs[rows[0]].constraint.mask_words), np.int32)
    fill_next_token_bitmask_par(_executor, [(seqs[i].constraint.matcher, j) for j, i in enumerate(rows)], bits)
    return TokenMask(np.asarray(rows, np.int32), bits)
