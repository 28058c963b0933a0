"""The numpy twins of the fused GEMVs (reference/kernels.py: rms_norm_linear, silu_mul_linear).

rms_norm_linear is the norm GEMVs' formula, the RMSNorm's scale out of the dot product:
    Y = fl(r * fl(sum_k a_k w_k)),  a_k = bf16(x_k g_k),  r = fl(1 / sqrt(mean(x^2) + eps))
(g the norm weight), against the exact RMSNorm-then-linear Y* = r* sum_k x_k g_k w_k in float64.
With u = 2^-24 (fp32) and S(v) = sum_k |v_k| |w_k|:
  - operand: x_k g_k is exact in fp32 (two 8-bit significands), so a_k = x_k g_k (1 + d_k) with
    |d_k| <= 2^-8 (bf16 keeps 8 significant bits, round to nearest): |sum (a - xg) w| <= 2^-8 S(xg);
  - the fp32 sum of k products, in any order: error <= g_k S(a), g_k = k u / (1 - k u);
  - r: the squares (u each), their sum (k u: positive terms), the division by k, eps's rounding
    to fp32 and the addition (u each) give mean + eps within (k + 3) u relative; the square
    root halves that and adds u, the reciprocal adds u: |r - r*| <= rho r*, rho = ((k + 3) / 2 + 2) u;
  - the final product: u.
So |Y - Y*| <= (1 + rho)(1 + u) r* (2^-8 S(xg) + g_k S(a)) + (rho + u + rho u) |Y*|, plus the
float64 oracle's own k 2^-53 r* S(xg). Valid on any IEEE CPU, whatever BLAS order numpy picks.
A row of tiny x (mean x^2 << eps) makes eps matter, so the check is not blind to it.
"""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.reference.kernels import (
    bf16_round,
    linear,
    rms_norm_linear,
    rms_norm_operand,
    silu_mul,
    silu_mul_linear,
    silu_mul_operand,
)

FP32_EPS = 2.0 ** -24


def norm_linear_bound(x, norm_w, w, eps):
    """(Y* in float64, the bound above) for x [m, k], norm_w [k], w [n, k]."""
    x64, g64, w64 = (np.asarray(v, np.float64) for v in (x, norm_w, w))
    k, u = x64.shape[-1], FP32_EPS
    r = 1 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    exact = r * ((x64 * g64) @ w64.T)
    gamma, rho = k * u / (1 - k * u), ((k + 3) / 2 + 2) * u
    s_xg = np.abs(x64 * g64) @ np.abs(w64).T
    s_a = np.abs(rms_norm_operand(x, norm_w).astype(np.float64)) @ np.abs(w64).T
    bound = ((1 + rho) * (1 + u) * r * (2.0 ** -8 * s_xg + gamma * s_a) + (rho + u + rho * u) * np.abs(exact)
             + k * 2.0 ** -53 * r * s_xg)
    return exact, bound


@pytest.mark.parametrize("m,n,k", [(1, 48, 576), (3, 40, 2048), (8, 16, 264), (2, 24, 8)])
def test_rms_norm_linear_against_float64(m, n, k):
    rng = np.random.default_rng()
    scale = rng.uniform(0.1, 30, (m, 1))
    scale[-1] = 1e-3                                        # mean x^2 ~ 1e-6 << eps: eps matters
    x = bf16_round(rng.standard_normal((m, k)) * scale)
    norm_w = bf16_round(1 + 0.2 * rng.standard_normal(k))
    w = bf16_round(rng.standard_normal((n, k)) / np.sqrt(k))
    np.testing.assert_array_equal(rms_norm_operand(x, norm_w), bf16_round(x.astype(np.float64) * norm_w))
    exact, bound = norm_linear_bound(x, norm_w, w, 1e-5)
    got = rms_norm_linear(x, norm_w, w, 1e-5)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.abs(got - exact) <= bound, True)


@pytest.mark.parametrize("m,n,inter", [(1, 64, 1536), (4, 32, 8192), (8, 16, 264)])
def test_silu_mul_operand_against_float64(m, n, inter):
    """silu_mul (the one formula the unfused and fused paths share) against an exact float64
    silu: the fp32 value is within a few ulps (exp <= 4 ulps, then three correctly rounded
    operations, and 1 + e^-gate cannot cancel), and the bf16 rounding adds at most 2^-8 relative
    (8 significant bits, round to nearest). Below fp32's smallest normal, 2^-126, relative error
    means nothing: an absolute allowance of 2^-126 * |gate * up| covers the subnormal results and
    e^-gate's overflow to inf for gate < -88.7 (the exact value there is |gate * up| * e^gate)."""
    rng = np.random.default_rng()
    gate_up = bf16_round(rng.standard_normal((m, 2 * inter)) * 3)
    gate_up[0, :5] = [-100.0, -89.0, -20.0, 0.0, 100.0]     # e^-gate overflow, tiny sigmoid, zero, saturation
    gate, up = gate_up[:, :inter].astype(np.float64), gate_up[:, inter:].astype(np.float64)
    exact = gate / (1 + np.exp(-gate)) * up
    fused = silu_mul_operand(gate_up)
    assert np.all(np.isfinite(fused))
    bound = (2.0 ** -8 + 16 * FP32_EPS) * np.abs(exact) + 2.0 ** -126 * np.abs(gate * up)
    np.testing.assert_array_equal(np.abs(fused - exact) <= bound, True)
    # the fused GEMV's product is the unfused chain's: bf16(silu_mul) then linear, bit for bit
    w = bf16_round(rng.standard_normal((n, inter)) / np.sqrt(inter))
    unfused = bf16_round(silu_mul(gate_up[:, :inter], gate_up[:, inter:]))
    np.testing.assert_array_equal(silu_mul_linear(gate_up, w), linear(unfused, w))


def test_fused_operands_are_bf16_values():
    """The operand a fused kernel feeds its tensor cores is bf16: rounding it again changes nothing."""
    rng = np.random.default_rng()
    x = bf16_round(rng.standard_normal((2, 64)))
    for operand in (rms_norm_operand(x, bf16_round(np.ones(64) * 1.1)), silu_mul_operand(x)):
        np.testing.assert_array_equal(bf16_round(operand), operand)
