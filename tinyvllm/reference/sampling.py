"""Sampling: the per-sequence parameters a runner gets (SamplingBatch) and the numpy twin of the
CUDA sampling kernel (cuda/sampling.cu). Both implement exactly this algorithm per row:

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
    Z = sum(w)                                 exact integer sum
    top-k (0 < k < V): tau_k = the k-th largest e (ties: every token equal to it is kept)
    top-p (p < 1):     target = ceil(double(p) * double(Z));
                       tau_p = the largest e value t with sum(w_i for e_i >= t) >= target, i.e.
                       the smallest set of most probable tokens holding >= p of the mass
                       (both thresholds are taken over the FULL distribution)
    keep token i  <=>  e_i >= tau = max(tau_k, tau_p)        (tau = 0 when both are off)
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

from tinyvllm.engine.batch import SamplingBatch

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


def sample_row(x: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, step: int) -> int:
    """One token from one logits row, by the algorithm in the module docstring."""
    x = np.asarray(x, np.float32)
    vocab = x.shape[0]
    if not temperature > 0:
        return int(np.argmax(x))
    e = exp_weights(x, temperature)
    w = mass(e)
    tau = np.float32(0.0)
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
                                   float(batch.top_p[i]), int(batch.seed[i]), int(batch.step[i]))
                        for i in range(batch.num_seqs)], np.int32)
    out[broken] = NON_FINITE
    return out
