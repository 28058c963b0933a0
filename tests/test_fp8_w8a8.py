"""FP8 W8A8 (quant/fp8.py), the twins of an FP8 projection of more than 8 rows: the per-token
activation quantization (quantize_rows_e4m3, cuda/fp8_quant.cu's twin) on known values (ties,
saturation, rows of zeros, negative zero, an amax of exactly 448) and against a brute-force
nearest-even search; the W8A8 product against float64 with a derived bound; and which twin the
reference model runs where (W8A8 above 8 rows, weight-only up to 8 and on the LM head)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
from test_quant_fp8 import CODES, FINITE, U32, VALUES, bf16_matrix, gamma

from tinyvllm.quant import fp8
from tinyvllm.quant.fp8 import E4M3, WEIGHT_ONLY_MAX_ROWS, quantize_per_channel, quantize_rows_e4m3

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_known_codes_ties_to_even_signed_zeros_and_the_subnormal_range():
    """A row whose amax is exactly 448 has scale 1, so each code is the e4m3 rounding of x itself:
    1 + 2^-4 is a tie between 1 (0x38, even) and 1.125 -> 0x38; 1 + 3 * 2^-4 a tie between 1.125
    and 1.25 (0x3A, even) -> 0x3A; 2^-10 a tie between 0 and the smallest subnormal 2^-9 -> 0;
    3 * 2^-10 a tie between 2^-9 (0x01) and 2^-8 (0x02, even) -> 0x02; -0 keeps its sign (0x80)."""
    x = np.array([[448, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, -0.0, 0.0]], np.float32)
    codes, scales = quantize_rows_e4m3(x)
    assert codes.dtype == np.uint8 and scales.dtype == np.float32 and scales[0] == 1
    np.testing.assert_array_equal(codes[0], [0x7E, 0x38, 0x3A, 0xB8, 0x00, 0x02, 0x80, 0x00])


def test_a_row_of_zeros_gets_scale_one_and_signed_zero_codes():
    x = np.zeros((3, 16), np.float32)
    x[0, ::2] = -0.0
    x[1, 5] = -3.0
    codes, scales = quantize_rows_e4m3(x)
    np.testing.assert_array_equal(scales[[0, 2]], [1, 1])
    np.testing.assert_array_equal(codes[0], np.tile([0x80, 0x00], 8))
    assert not codes[2].any() and codes[1, 5] == 0xFE and scales[1] == np.float32(3) / np.float32(448)


def test_the_row_amax_saturates_to_448_where_its_scale_rounded_down():
    """scale = fl32(amax / 448) may round down, putting amax / scale just above 448: the clip (the
    kernel's clamp and __NV_SATFINITE) makes it 448 (0x7E / 0xFE), never NaN."""
    amax = ((1 + np.arange(128) / 128)[None, :] * 2.0 ** np.arange(-20, 21)[:, None]).reshape(-1)   # bf16 values
    x = np.stack([amax, -amax / 3], axis=1).astype(BF16).astype(np.float32)
    scale = x[:, 0] / np.float32(448)
    assert (x[:, 0] / scale > 448).any(), "no row exercised the clip"
    codes, scales = quantize_rows_e4m3(x)
    np.testing.assert_array_equal(scales, scale)
    assert np.all(codes[:, 0] == 0x7E)


def test_codes_are_the_nearest_e4m3_value_of_the_quotient_ties_to_even():
    """Every code against a search over the code table, as the weights' test does; X rounded to bf16
    first (the GPU's X is bf16), so a float32 X and its bf16 rounding quantize alike."""
    x = bf16_matrix(24, 96, seed=11).astype(np.float32)
    codes, scales = quantize_rows_e4m3(x)
    quotient = np.clip(x / scales[:, None], -448, 448).astype(np.float64)
    distance = np.abs(quotient.reshape(-1, 1) - np.where(FINITE, VALUES, np.inf)[None, :])
    nearest = distance == distance.min(axis=1, keepdims=True)
    even = nearest & (CODES[None, :] % 2 == 0)
    chosen = np.where(even.any(axis=1), even.argmax(axis=1), nearest.argmax(axis=1))
    np.testing.assert_array_equal(codes.reshape(-1), CODES[chosen])
    noisy = x + np.float32(2.0 ** -12) * np.abs(x)          # the same bf16 values
    np.testing.assert_array_equal(quantize_rows_e4m3(noisy)[0], codes)
    # the weights quantize by the same rule
    np.testing.assert_array_equal(quantize_per_channel(x).codes.view(np.uint8), codes)


def test_w8a8_against_float64_of_the_same_quantized_product():
    """Reference: sum_c qx qw in float64 (exact: k * 448^2 < 2^53 and each product has 8 significant
    bits), times both scales. Twin: the float32 sum of k exact products, off by at most
    gamma_k * sum |qx qw|, then two float32 multiplies by the scales (each 2^-24 relative)."""
    k = 512
    w = quantize_per_channel(bf16_matrix(48, k, seed=12))
    x = np.random.default_rng(13).standard_normal((21, k)).astype(BF16).astype(np.float32)
    qx, sx = quantize_rows_e4m3(x)
    qx64, qw64 = qx.view(E4M3).astype(np.float64), w.codes.astype(np.float64)
    scales = sx.astype(np.float64)[:, None] * w.row_scales().astype(np.float64)[None, :]
    reference = (qx64 @ qw64.T) * scales
    twin = fp8.w8a8_linear(x, w)
    assert twin.dtype == np.float32 and twin.shape == (21, 48)
    magnitude = (np.abs(qx64) @ np.abs(qw64).T) * scales
    bound = magnitude * gamma(k, U32) * (1 + U32) ** 2 + 3 * U32 * np.abs(reference)
    assert (np.abs(twin - reference) <= bound).all()
    # and close to the unquantized product: both operands within e4m3's 2^-4 relative half-ulp
    exact = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    assert np.linalg.norm(twin - exact) < 0.1 * np.linalg.norm(exact)


def test_linear_is_weight_only_up_to_8_rows_and_w8a8_above():
    w = quantize_per_channel(bf16_matrix(16, 64, seed=14))
    x = np.random.default_rng(15).standard_normal((WEIGHT_ONLY_MAX_ROWS + 1, 64)).astype(np.float32)
    assert WEIGHT_ONLY_MAX_ROWS == 8
    np.testing.assert_array_equal(fp8.linear(x[:8], w), fp8.weight_only_linear(x[:8], w))
    np.testing.assert_array_equal(fp8.linear(x, w), fp8.w8a8_linear(x, w))
    assert not np.array_equal(fp8.w8a8_linear(x, w)[:8], fp8.weight_only_linear(x[:8], w))


def test_the_reference_model_runs_w8a8_above_8_rows_and_a_weight_only_head(tiny_model_dir):
    """The reference model's layer linears see the step's rows (the GPU's m): a 12-token prefill
    runs W8A8, a 3-sequence decode weight-only; an FP8 LM head stays weight-only at 12 rows, as the
    GPU's head (its GEMV 8 rows at a time)."""
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    from tinyvllm.reference.model import ReferenceModel
    config = ModelConfig.from_pretrained(tiny_model_dir)
    model = ReferenceModel(config, load_weights(tiny_model_dir, config, "fp8"))
    model.lm_head = quantize_per_channel(model.lm_head)
    seen = []
    model.observer = lambda name, args, out: seen.append((args, out)) if name == "linear" else None
    model.forward_full(np.arange(1, 13))
    assert len(seen) == 4 * config.num_hidden_layers + 1
    for (x, weight), out in seen[:-1]:
        assert x.shape[0] == 12 and isinstance(weight, fp8.Fp8Weight)
        np.testing.assert_array_equal(out, fp8.w8a8_linear(x, weight))
    (x, head), logits = seen[-1]
    assert head is model.lm_head and x.shape[0] == 12
    np.testing.assert_array_equal(logits, fp8.weight_only_linear(x, head))
    seen.clear()
    model.forward_full(np.arange(1, 4))
    for (x, weight), out in seen:
        np.testing.assert_array_equal(out, fp8.weight_only_linear(x, weight))
