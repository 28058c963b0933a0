"""The numpy twins of the fused GEMVs (reference/kernels.py: rms_norm_linear, silu_mul_linear)
against the composition of the unfused twins they replace: bf16(rms_norm) then linear, and
bf16(silu_mul) then linear.

The twins write the kernels' formulas (inverse RMS as a factor; silu as gate / (1 + e^-gate)),
the unfused twins theirs (x / sqrt(.); the tanh sigmoid): the fp32 operands differ by a few fp32
ulps, so after the bf16 rounding each operand value is equal or one bf16 ulp apart:
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
def test_silu_mul_linear_equals_silu_then_linear(m, n, inter):
    rng = np.random.default_rng()
    gate_up = bf16_round(rng.standard_normal((m, 2 * inter)) * 3)
    gate_up[0, :4] = [-100.0, -89.0, 0.0, 100.0]           # e^-gate overflow, zero, saturation
    w = bf16_round(rng.standard_normal((n, inter)) / np.sqrt(inter))
    unfused = bf16_round(silu_mul(gate_up[:, :inter], gate_up[:, inter:]))
    fused = silu_mul_operand(gate_up)
    assert np.all(np.isfinite(fused))
    _check_operand(fused, unfused)
    _check_product(silu_mul_linear(gate_up, w), linear(unfused, w), fused, w)


def test_fused_operands_are_bf16_values():
    """The operand a fused kernel feeds its tensor cores is bf16: rounding it again changes nothing."""
    rng = np.random.default_rng()
    x = bf16_round(rng.standard_normal((2, 64)))
    for operand in (rms_norm_operand(x, bf16_round(np.ones(64)), 1e-6), silu_mul_operand(x)):
        np.testing.assert_array_equal(bf16_round(operand), operand)
