"""FP8 e4m3 weights (tinyvllm/quant/fp8.py): quantize -> dequantize round trips within the error
bound derived from e4m3's 3 mantissa bits, the codes checked against a brute-force nearest-even
search over all 256 codes, and the FP8 linear twin against float64 with a derived bound."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.fp8 import (
    E4M3,
    E4M3_MAX,
    Fp8Weight,
    dequantize_per_channel,
    dequantize_per_tensor,
    linear,
    quantize_per_channel,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
U32 = 2.0 ** -24
CODES = np.arange(256, dtype=np.uint8)
VALUES = CODES.view(E4M3).astype(np.float64)           # every code's value (NaN at 0x7F, 0xFF)
FINITE = np.isfinite(VALUES)


def bf16_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows of very different magnitudes, each with a few large entries, so that most of a row
    falls far below its maximum and e4m3's subnormal range is exercised; one row of zeros."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-6, 3, (rows, 1))
    w[:, ::17] *= 300
    w[rows // 2] = 0
    return w.astype(BF16)


def test_round_trip_error_is_within_the_e4m3_bound():
    """|q * scale - w| <= (2^-4 + 2^-23)|w| + 2^-10 * scale (fp8.py derives it), evaluated in
    float64 where q * scale is exact (4 + 24 significant bits)."""
    w = bf16_matrix(64, 256, seed=0)
    fp8 = quantize_per_channel(w)
    assert fp8.codes.dtype == E4M3 and fp8.scale.dtype == np.float32 and fp8.per_channel
    w64 = w.astype(np.float64)
    scale = fp8.scale.astype(np.float64)[:, None]
    error = np.abs(fp8.codes.astype(np.float64) * scale - w64)
    assert (error <= (2.0 ** -4 + 2.0 ** -23) * np.abs(w64) + 2.0 ** -10 * scale).all()
    subnormal = np.abs(w64 / scale) < 2.0 ** -6
    assert subnormal.sum() > 100 and (~subnormal).sum() > 1000      # both ranges were exercised


def test_codes_are_the_nearest_e4m3_value_ties_to_even():
    """Each code against a search over the whole code table: the nearest finite value to
    clip(fl32(w / scale)), and on a tie the code whose last mantissa bit is 0."""
    w = bf16_matrix(16, 128, seed=1)
    fp8 = quantize_per_channel(w)
    quotient = np.clip(w.astype(np.float32) / fp8.scale[:, None], -E4M3_MAX, E4M3_MAX).astype(np.float64)
    distance = np.abs(quotient.reshape(-1, 1) - np.where(FINITE, VALUES, np.inf)[None, :])
    nearest = distance == distance.min(axis=1, keepdims=True)
    even = nearest & (CODES[None, :] % 2 == 0)
    chosen = np.where(even.any(axis=1), even.argmax(axis=1), nearest.argmax(axis=1))
    np.testing.assert_array_equal(fp8.codes.astype(np.float64).reshape(-1), VALUES[chosen])


def test_scales_are_the_row_absmax_over_448_and_the_absmax_maps_to_448():
    w = bf16_matrix(32, 64, seed=2)
    fp8 = quantize_per_channel(w)
    amax = np.abs(w.astype(np.float32)).max(axis=1)
    live = amax > 0
    np.testing.assert_array_equal(fp8.scale[live], amax[live] / np.float32(448))
    codes = np.abs(fp8.codes.astype(np.float32))
    np.testing.assert_array_equal(codes.max(axis=1)[live], 448)


def test_a_zero_row_gets_scale_one_and_zero_codes():
    w = np.zeros((3, 16), BF16)
    w[1, 2] = 1.5
    fp8 = quantize_per_channel(w)
    assert fp8.scale[0] == 1 and fp8.scale[2] == 1
    assert not fp8.codes[[0, 2]].astype(np.float32).any()
    np.testing.assert_array_equal(fp8.dequantize(), w.astype(np.float32))


def test_a_non_finite_weight_is_one_error_naming_the_tensor():
    w = np.ones((2, 8), np.float32)
    w[1, 3] = np.nan
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.up_proj.weight' holds a non-finite"):
        quantize_per_channel(w, "model.layers.0.mlp.up_proj.weight")


def test_every_e4m3_value_is_exact_in_bf16():
    """What lets the GEMV feed the bytes to bf16 MMAs without rounding."""
    finite = VALUES[FINITE]
    np.testing.assert_array_equal(finite.astype(BF16).astype(np.float64), finite)
    via_bf16 = CODES[FINITE].view(E4M3).astype(BF16).astype(np.float64)
    np.testing.assert_array_equal(via_bf16, finite)


def test_per_tensor_and_per_channel_dequantization():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, (6, 10), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0                          # no NaN codes
    codes = codes.view(E4M3)
    scale = rng.uniform(1e-4, 1, 6).astype(np.float32)
    expected = codes.astype(np.float32) * scale[:, None]       # fl32(q * s): one rounding
    np.testing.assert_array_equal(dequantize_per_channel(codes, scale), expected)
    np.testing.assert_array_equal(dequantize_per_channel(codes, scale.reshape(6, 1)), expected)
    np.testing.assert_array_equal(dequantize_per_tensor(codes, scale[0]), codes.astype(np.float32) * scale[0])
    assert not Fp8Weight(codes, np.float32(2).reshape(())).per_channel


def test_fp8_weight_checks_its_arrays():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight(np.zeros((2, 2), np.float32), np.ones(2, np.float32))
    with pytest.raises(ValueError, match="shape"):
        Fp8Weight(np.zeros((2, 2), E4M3), np.ones(3, np.float32))


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_linear_against_float64_dequantize_then_matmul(per_channel):
    """Reference: X @ (q * scale)^T in float64 (X bf16 values; each product exact, the sum off by
    at most k * 2^-53 relative). Twin: the float32 sum of k exact products x * q, off by
    gamma_k * sum |x q|, times the scale (one more float32 rounding, 2^-24 of the result)."""
    k = 384
    fp8 = quantize_per_channel(bf16_matrix(40, k, seed=4))
    if not per_channel:
        fp8 = Fp8Weight(fp8.codes, np.float32(fp8.scale.max()).reshape(()))
    x = np.random.default_rng(5).standard_normal((7, k)).astype(BF16).astype(np.float32)
    q = fp8.codes.astype(np.float64)
    scale = fp8.row_scales().astype(np.float64)[None, :]
    reference = (x.astype(np.float64) @ q.T) * scale
    twin = linear(x, fp8)
    assert twin.dtype == np.float32 and twin.shape == (7, 40)
    magnitude = (np.abs(x).astype(np.float64) @ np.abs(q).T) * scale
    bound = magnitude * (gamma(k, U32) * (1 + U32) + k * 2.0 ** -52) + U32 * np.abs(twin)
    assert (np.abs(twin - reference) <= bound).all()


def test_fp8_linear_rounds_x_to_bf16():
    fp8 = quantize_per_channel(bf16_matrix(8, 64, seed=6))
    x = np.random.default_rng(7).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(linear(x, fp8), linear(x.astype(BF16).astype(np.float32), fp8))
