"""Sampling: the numpy twins of the CUDA sampling kernels (cuda/sampling.cu), run on a step's
logits and its SamplingBatch (engine/batch.py).

One step, in vLLM V1's order (vllm/v1/sample/sampler.py: raw logprobs, then the non-argmax-
invariant processors min_tokens and logit_bias, then the penalties repetition -> frequency ->
presence, then temperature, the argmax-invariant min_p, then top-k/top-p and the draw):

    apply_token_mask(logits, batch.token_mask)   structured outputs: -inf for every token a
                                          constrained row's grammar refuses (structured/mask.py),
                                          launched only when some row has a constraint
    raw = logits                          step_logprobs() reads these (a copy, on the GPU)
    apply_edits(logits, batch.edits)      min_tokens, logit_bias, repetition, frequency,
                                          presence: sparse in-place edits (engine/logit_edits.py's
                                          LogitEdits), launched only when some row has one
    sample(logits, batch)                 temperature, min_p, top-k, top-p, the draw (below)
    step_logprobs(raw[rows], ids[rows])   only when some row asked for logprobs

The sampler (sample_tokens) implements exactly this algorithm per row:

    x = logits row (fp32, length V)
    any NaN or +inf in x, or no finite value -> NON_FINITE (-1): a broken row has no meaningful
                               token, and any id it produced would be garbage (the engine fails
                               that request alone). -inf entries are fine: they have no mass.
    T <= 0                   -> argmax(x), lowest index on ties. Done.
    m = max(x); s = 1/T (fp32, correctly rounded)
    e_i = exp2_f32((x_i - m) * s * LOG2E)      fp32, every op rounded separately (no FMA), with
                                               the polynomial below; e_i in [0, 1], e_max = 1
    w_i = rint(e_i * 2^40)                     integer "mass" of token i (uint64); a token whose
                                               e < 2^-41 has no mass and is never drawn
    min_p (p_min > 0): drop every token with e_i < p_min (fp32 compare). e_i is p_i / p_max
                       exactly as vLLM's test "p_i < min_p * p_max" reads, so min_p costs one
                       compare; as in vLLM it comes before top-k/top-p, so top-p's mass is that
                       of the tokens min_p keeps
    Z = sum(w_i for e_i >= p_min)              exact integer sum (p_min = 0: every token)
    top-k (0 < k < V): tau_k = the k-th largest e (ties: every token equal to it is kept)
    top-p (p < 1):     target = ceil(double(p) * double(Z));
                       tau_p = the largest e value t with sum(w_i for e_i >= t) >= target, i.e.
                       the smallest set of most probable tokens holding >= p of the mass
                       (both thresholds are taken over the full distribution, not each
                       other's: here top-p does not renormalise after top-k as vLLM does)
    keep token i  <=>  e_i >= tau = max(tau_k, tau_p, p_min)      (tau = 0 when all are off)
    M = sum(w_i kept); u24 = hash(seed, step) >> 40 (24 random bits)
    r = floor(M * u24 / 2^24)                  exact, 0 <= r < M
    token = the first index i (index order) with sum(w_j kept, j <= i) > r

Every step after e_i is integer arithmetic, so sums do not depend on the order of additions:
numpy and CUDA agree token for token whenever their e_i agree, and e_i is built from IEEE
single ops written identically in both. Randomness is counter based: the draw depends only on
(seed, step = tokens generated so far), never on batch composition, preemption or the device.
"""
from __future__ import annotations

import math

import numpy as np

from tinyvllm.engine.batch import SamplingBatch, StepLogprobs
from tinyvllm.engine.logit_edits import LogitEdits

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MASS_BITS = 40                      # w_i = rint(e_i * 2^40); sums of 128K tokens fit in uint64
NON_FINITE = -1                     # the id sampled from a row with NaN / +inf / no finite logit


def _f32(bits: int) -> np.float32:
    """A float32 constant given by its bit pattern, so numpy and CUDA use the very same value."""
    return np.array([bits], np.uint32).view(np.float32)[0]


LOG2E = _f32(0x3FB8AA3B)
# 2^f = sum (ln 2)^k / k! f^k, k = 0..6, for f in [-0.5, 0.5] (relative error < 2e-7)
EXP2_COEFFS = [_f32(b) for b in (0x39218489, 0x3AAEC3FF, 0x3C1D955B, 0x3D635847,
                                  0x3E75FDF0, 0x3F317218, 0x3F800000)]   # k = 6 .. 0


def mix64(z: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit mix (same constants as cuda/sampling.cu)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def random_bits24(seed: int, step: int) -> int:
    """24 uniform random bits for draw number `step` of a request with this seed."""
    return mix64((mix64(seed & MASK64) + (step + 1) * GOLDEN_GAMMA) & MASK64) >> 40


def exp_weights(x: np.ndarray, temperature: float) -> np.ndarray:
    """e_i = exp((x_i - max) / T) in fp32, exactly as cuda/sampling.cu's weight_exp()."""
    x = np.asarray(x, np.float32)
    inv_t = np.float32(1.0) / np.float32(temperature)
    t = ((x - x.max()) * inv_t) * LOG2E
    out = np.zeros_like(t)
    ok = t >= np.float32(-125.0)                 # below: e < 2^-125, no mass anyway
    t = t[ok]
    n = np.rint(t)
    f = t - n
    p = EXP2_COEFFS[0] * np.ones_like(f)
    for c in EXP2_COEFFS[1:]:
        p = p * f + c                            # two roundings, like __fmul_rn / __fadd_rn
    out[ok] = p * np.ldexp(np.float32(1.0), n.astype(np.int32)).astype(np.float32)
    return out


def mass(e: np.ndarray) -> np.ndarray:
    return np.rint(e.astype(np.float64) * float(1 << MASS_BITS)).astype(np.uint64)


def sample_row(x: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, step: int,
               min_p: float = 0.0) -> int:
    """One token from one logits row, by the algorithm in the module docstring."""
    x = np.asarray(x, np.float32)
    vocab = x.shape[0]
    if not temperature > 0:
        return int(np.argmax(x))
    e = exp_weights(x, temperature)
    p_min = np.float32(min_p)
    w = np.where(e >= p_min, mass(e), np.uint64(0))     # min_p's survivors carry the mass
    tau = p_min
    if 0 < top_k < vocab:
        tau = max(tau, np.partition(e, vocab - top_k)[vocab - top_k])
    if np.float32(top_p) < 1:
        target = math.ceil(float(np.float32(top_p)) * float(int(w.sum())))
        order = np.argsort(-e, kind="stable")
        crossing = int(np.searchsorted(np.cumsum(w[order]), target, side="left"))
        tau = max(tau, e[order[crossing]])
    kept_w = np.where(e >= tau, w, np.uint64(0))
    cdf = np.cumsum(kept_w)
    total = int(cdf[-1])
    u = random_bits24(seed, step)
    r = (total >> 24) * u + (((total & 0xFFFFFF) * u) >> 24)
    return int(np.searchsorted(cdf, r, side="right"))


def sample(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """Numpy twin of the CUDA sampler: logits float32 [S, V] -> int32 [S] (NON_FINITE for a
    broken row)."""
    broken = ~np.isfinite(logits.max(axis=-1))     # max is NaN for any NaN, +inf for any +inf,
    if batch.all_greedy:                           # -inf when nothing is finite
        out = np.argmax(logits, axis=-1).astype(np.int32)
    else:
        out = np.array([NON_FINITE if broken[i] else
                        sample_row(logits[i], float(batch.temperature[i]), int(batch.top_k[i]),
                                   float(batch.top_p[i]), int(batch.seed[i]), int(batch.step[i]),
                                   float(batch.min_p[i]))
                        for i in range(batch.num_seqs)], np.int32)
    out[broken] = NON_FINITE
    return out


def apply_edits(logits: np.ndarray, edits: LogitEdits | None) -> np.ndarray:
    """Numpy twin of sampling.cu's apply_logit_edits: LogitEdits' five fp32 operations on each
    listed (row, token), in place. Returns logits."""
    if edits is None or edits.num_entries == 0:
        return logits
    ok = (edits.token >= 0) & (edits.token < logits.shape[1])
    row, tok = edits.row[ok], edits.token[ok]
    x = logits[row, tok].astype(np.float32)
    y = np.where(edits.forbid[ok], np.float32(-np.inf), x)
    y = y + edits.bias[ok]
    rep = edits.rep[ok]
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.where(y > 0, y / rep, y * rep).astype(np.float32)
        y = (y - edits.freq[ok]) - edits.pres[ok]
    logits[row, tok] = np.where(x < np.float32(np.inf), y, x)     # NaN / +inf: left broken
    return logits


def apply_token_mask(logits: np.ndarray, mask) -> np.ndarray:
    """Numpy twin of token_mask.cu's apply_token_mask: in each masked row (mask.rows), every
    logit whose bit in mask.bits is 0 becomes -inf, whatever it was (NaN included); the others
    are left alone. In place; returns logits."""
    if mask is None or not len(mask.rows):
        return logits
    vocab = logits.shape[1]
    words = np.ascontiguousarray(mask.bits, np.int32).view(np.uint32)
    allowed = ((words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(len(words), -1)[:, :vocab]
    rows = logits[mask.rows]
    rows[allowed == 0] = np.float32(-np.inf)
    logits[mask.rows] = rows
    return logits


def ordered_keys(x: np.ndarray) -> np.ndarray:
    """uint32 keys whose integer order is the float order (sampling.cu's ordered_key)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def head_argmax_keys(logits: np.ndarray) -> np.ndarray:
    """Numpy twin of the decode LM head's greedy argmax keys (cuda/common.cuh argmax_key):
    per row the largest (ordered key of the value) << 32 | (2^32 - 1 - index), NaN (either sign)
    as the largest key and -0 as +0, so the key names the row's max, its lowest index among equal
    values (float equality), and whether the row is broken. -> uint64 [rows]."""
    x = np.asarray(logits, np.float32)
    x = np.where(x == 0, np.float32(0), x)
    bits = np.where(np.isnan(x), np.uint32(0xFFFFFFFF), ordered_keys(x)).astype(np.uint64)
    low = np.uint64(0xFFFFFFFF) - np.arange(x.shape[-1], dtype=np.uint64)
    return ((bits << np.uint64(32)) | low).max(axis=-1)


def step_logprobs(logits_rows: np.ndarray, sampled_ids: np.ndarray, k: int):
    """Numpy twin of sampling.cu's step_logprobs: raw log-probabilities of rows of fp32 logits.
    -> (sampled_logprob float32 [R], sampled_rank int32 [R], top_ids int32 [R, k],
        top_logprobs float32 [R, k]).

    lse = fp32(m + log(sum exp(x - m)))   in float64, m the row's max
    logprob_i = fp32(x_i - lse)           one fp32 subtraction
    rank = number of tokens with x_j >= x_sampled (vLLM counts ">=" too: 1 = the best)
    top k: largest x first, lower id first among equal ones (ordered_keys order)
    A sampled id outside the vocabulary (a broken row's -1) gets logprob NaN and rank 0."""
    x = np.asarray(logits_rows, np.float32)
    rows, vocab = x.shape
    if not 0 <= k <= vocab:
        raise ValueError(f"step_logprobs: k must be in [0, {vocab}], got {k}")
    sampled = np.asarray(sampled_ids, np.int64)
    m = x.max(axis=1).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = (m + np.log(np.exp(x.astype(np.float64) - m[:, None]).sum(axis=1))).astype(np.float32)
        lp = x - lse[:, None]
    valid = (sampled >= 0) & (sampled < vocab)
    safe = np.where(valid, sampled, 0)
    xs = x[np.arange(rows), safe]
    sampled_lp = np.where(valid, lp[np.arange(rows), safe], np.float32(np.nan)).astype(np.float32)
    rank = np.where(valid, (x >= xs[:, None]).sum(axis=1), 0).astype(np.int32)
    keys = ordered_keys(x).astype(np.int64)
    top = np.zeros((rows, k), np.int32)
    for r in range(rows):
        if k:
            top[r] = np.lexsort((np.arange(vocab), -keys[r]))[:k]
    top_lp = np.take_along_axis(lp, top.astype(np.int64), axis=1).astype(np.float32)
    return sampled_lp, rank, top, top_lp


def sample_step(logits: np.ndarray, batch: SamplingBatch) -> tuple[np.ndarray, StepLogprobs | None]:
    """The whole step as the CUDA runner runs it: token mask, raw logprobs' copy, edits,
    sampler, logprobs. logits are modified (masked, edited); -> (ids int32 [S], StepLogprobs or None)."""
    apply_token_mask(logits, batch.token_mask)
    rows = batch.logprob_rows
    raw = logits[rows].copy() if len(rows) else None
    ids = sample(apply_edits(logits, batch.edits), batch)
    if raw is None:
        return ids, None
    lp, rank, top, top_lp = step_logprobs(raw, ids[rows], batch.logprob_k)
    return ids, StepLogprobs(rows, lp, rank, top, top_lp)
