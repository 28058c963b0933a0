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
    rows = [i for i, s in enumerate(seqs) if getattr(s, "constraint", None) is not None
            and s.num_cached_tokens + s.num_scheduled_tokens >= len(s.token_ids)]
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
