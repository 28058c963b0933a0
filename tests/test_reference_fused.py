"""The numpy twins of the fused GEMVs (reference/kernels.py: rms_norm_linear, silu_mul_linear)
against the composition of the unfused twins they replace: bf16(rms_norm) then linear, and
bf16(silu_mul) then linear (silu_mul is one formula for both paths; its test is against float64).

The norm twin writes the kernel's formula (inverse RMS as a factor), the unfused twin its own
(x / sqrt(.)): the fp32 operands differ by a few fp32 ulps, so after the bf16 rounding each operand value is equal or one bf16 ulp apart:
    |a - b| <= 2^-7 * max(|a|, |b|)      (bf16 keeps 8 significant bits)
and nearly always equal (a straddled rounding boundary needs the fp32 values to fall within a
few 2^-24 of one, out of a 2^-8-wide interval). Through the float32 matmul of inner size k,
    |Y - Y'| <= 2^-7 * (|a| @ |W|^T) + 2 * k * 2^-24 * (|a| @ |W|^T)
(the second term: each side's own fp32 accumulation error, bounded by k * 2^-24 times the sum of
absolute products).
"""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.reference.kernels import (
    bf16_round,
    linear,
    rms_norm,
    rms_norm_linear,
    rms_norm_operand,
    silu_mul,
    silu_mul_linear,
    silu_mul_operand,
)

BF16_ULP = 2.0 ** -7
FP32_EPS = 2.0 ** -24


def _check_operand(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(np.abs(a - b) <= BF16_ULP * np.maximum(np.abs(a), np.abs(b)), True)
    assert np.mean(a == b) > 0.99, f"only {np.mean(a == b):.2%} of the operand values agree exactly"


def _check_product(y: np.ndarray, y_ref: np.ndarray, operand: np.ndarray, w: np.ndarray) -> None:
    k = operand.shape[-1]
    scale = np.abs(operand) @ np.abs(w).T
    bound = (BF16_ULP + 2 * k * FP32_EPS) * scale
    np.testing.assert_array_equal(np.abs(y - y_ref) <= bound, True)


@pytest.mark.parametrize("m,n,k", [(1, 48, 576), (3, 40, 2048), (8, 16, 264), (2, 24, 8)])
def test_rms_norm_linear_equals_norm_then_linear(m, n, k):
    rng = np.random.default_rng()
    x = bf16_round(rng.standard_normal((m, k)) * rng.uniform(0.1, 30))
    norm_w = bf16_round(1 + 0.2 * rng.standard_normal(k))
    w = bf16_round(rng.standard_normal((n, k)) / np.sqrt(k))
    unfused = bf16_round(rms_norm(x, norm_w, 1e-5))         # what rms_norm stores
    fused = rms_norm_operand(x, norm_w, 1e-5)
    _check_operand(fused, unfused)
    _check_product(rms_norm_linear(x, norm_w, w, 1e-5), linear(unfused, w), fused, w)


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
    for operand in (rms_norm_operand(x, bf16_round(np.ones(64)), 1e-6), silu_mul_operand(x)):
        np.testing.assert_array_equal(bf16_round(operand), operand)
