"""GGUF block formats (tinyvllm/quant/gguf_*.py) against an independent implementation: the `gguf`
package's numpy dequantization (llama.cpp's authors'), on random blocks and on the default
model's real Q4_1 file; the quantized linear twin against float64 with derived bounds; the block
reader's errors."""
from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest
from quant_reference import exact_dequantize

from tinyvllm.checkpoint.gguf import unpermute_rope_rows
from tinyvllm.checkpoint.gguf_tensors import read_gguf_weights
from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.block_format import (
    GEMV_MAX_ROWS,
    QuantizedWeight,
    affine_blocks,
    factored_error_bound,
    linear,
    linear_dequantized,
    linear_factored,
)
from tinyvllm.quant.weight_kinds import BLOCK_FORMATS

FORMATS = list(BLOCK_FORMATS.values())
IDS = list(BLOCK_FORMATS)
U32 = 2.0 ** -24          # float32 unit roundoff
BF16 = np.dtype(ml_dtypes.bfloat16)


def random_raw(fmt, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: random bytes for every quant field, finite fp16 scales and mins
    (normal, subnormal, negative and zero among them) in the fp16 fields."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, fmt.row_bytes(cols)), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.block_bytes)
    for offset in fmt.fp16_fields:
        values = rng.normal(0, 0.02, len(blocks)) * rng.choice([1.0, 1e-6, 0.0, 30.0], len(blocks))
        blocks[:, offset:offset + 2] = values.astype("<f2").reshape(-1, 1).view(np.uint8)
    return raw


def gguf_dequantize(fmt, raw: np.ndarray, shape) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt.name]), np.float32).reshape(shape)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_block_sizes_are_gguf_s(fmt):
    qtype = gguf.GGMLQuantizationType[fmt.name]
    assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.block_elements, fmt.block_bytes)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantize_equals_gguf_bit_for_bit_on_random_blocks(fmt):
    shape = (37, fmt.block_elements * 5)
    raw = random_raw(fmt, *shape, seed=1)
    ours = fmt.dequantize(raw, shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours.view(np.uint32), gguf_dequantize(fmt, raw, shape).view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantize_is_the_exact_value_rounded_once_to_float32(fmt):
    """Against the element-by-element float64 decoder of tests/quant_reference.py."""
    shape = (6, fmt.block_elements * 2)
    raw = random_raw(fmt, *shape, seed=10)
    np.testing.assert_array_equal(fmt.dequantize(raw, shape), exact_dequantize(fmt, raw, shape).astype(np.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_bf16_weights_are_one_rounding_of_the_float32_value(fmt):
    shape = (16, fmt.block_elements * 3)
    raw = random_raw(fmt, *shape, seed=2)
    reference = gguf_dequantize(fmt, raw, shape).astype(BF16)        # ml_dtypes: nearest even
    ours = fmt.dequantize_bf16(raw, shape)
    assert ours.dtype == BF16
    np.testing.assert_array_equal(ours.view(np.uint16), reference.view(np.uint16))


@pytest.fixture(scope="module")
def default_file():
    from tinyvllm.checkpoint.default_model import default_gguf_path
    try:
        path = default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    return path, gguf.GGUFReader(path), read_gguf_weights(path)


def test_default_model_tensors_dequantize_like_gguf(default_file):
    """A few tensors of each block type the real file holds (its Q8_0 embedding: the first 4096
    rows), every value bit for bit equal to gguf's dequantization."""
    path, reader, weights = default_file
    by_type: dict[str, list] = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    blocks = {k: v for k, v in by_type.items() if k in BLOCK_FORMATS}
    assert set(blocks) == {"Q8_0", "Q4_1"}, set(blocks)       # what the default model's file holds
    for kind, tensors in blocks.items():
        for t in tensors[:: max(1, len(tensors) // 4)]:
            w = weights[t.name]
            assert isinstance(w, QuantizedWeight) and w.format.name == kind
            rows = min(w.shape[0], 4096)
            raw = np.asarray(t.data)[:rows]
            expected = gguf.quants.dequantize(raw, t.tensor_type).reshape(rows, w.shape[1])
            ours = w.format.dequantize(w.blocks[:rows], (rows, w.shape[1]))
            np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32), err_msg=t.name)


def test_default_model_float_tensors_are_read_as_stored(default_file):
    path, reader, weights = default_file
    for t in reader.tensors:
        if t.tensor_type.name == "F32":
            np.testing.assert_array_equal(weights[t.name], np.asarray(t.data).reshape(weights[t.name].shape))
    assert len(weights) == len(reader.tensors)


def bf16_values(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(BF16).astype(np.float32)


def gamma(n: int, u: float) -> float:
    """The classic bound on summing n terms in floating point: |error| <= gamma_n * sum |term|."""
    return n * u / (1 - n * u)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_quantized_linear_against_float64_dequantize_then_matmul(fmt):
    """|twin - X @ W^T| with W the exact (float64) weights and X bf16 values: the bf16 rounding of
    a weight after its float32 value costs at most (2^-8 + 2^-23)|w| (2^-8: bf16's half-ulp;
    2^-24 + 2^-32: the float32 rounding before it), the float32 sum of k exact products
    gamma_k * sum |x w_bf16| with |w_bf16| <= (1 + 2^-7)|w|, the float64 reference k * 2^-53."""
    k = fmt.block_elements * 4
    raw = random_raw(fmt, 24, k, seed=3)
    qweight = QuantizedWeight.from_raw(fmt, (24, k), raw, "w")
    x = bf16_values((5, k), seed=4)
    w64 = exact_dequantize(fmt, raw, (24, k))
    reference = x.astype(np.float64) @ w64.T
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w64).T
    bound = magnitude * ((2.0 ** -8 + 2.0 ** -23) + gamma(k, U32) * (1 + 2.0 ** -7) + k * 2.0 ** -53)
    twin = linear(x, qweight)
    assert twin.dtype == np.float32 and twin.shape == (5, 24)
    assert (np.abs(twin - reference) <= bound).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_quantized_linear_multiplies_by_the_bf16_weights(fmt):
    """With the bf16 weights (gguf's float32 dequantization, rounded by ml_dtypes) as the
    reference, only the float32 sum is left: gamma_k * sum |x w_bf16|. And X is rounded to bf16
    first: a float32 X gives the same result as its bf16 rounding."""
    k = fmt.block_elements * 4
    raw = random_raw(fmt, 24, k, seed=5)
    qweight = QuantizedWeight.from_raw(fmt, (24, k), raw, "w")
    w_bf16 = gguf_dequantize(fmt, raw, (24, k)).astype(BF16).astype(np.float64)
    x32 = np.random.default_rng(6).standard_normal((3, k)).astype(np.float32)
    x = x32.astype(BF16).astype(np.float64)
    bound = gamma(k, U32) * (np.abs(x) @ np.abs(w_bf16).T)
    twin = linear_dequantized(x32, qweight)
    assert (np.abs(twin - x @ w_bf16.T) <= bound).all()
    np.testing.assert_array_equal(twin, linear_dequantized(x.astype(np.float32), qweight))


NIBBLE_FORMATS = [f for f in FORMATS if f.nibble_offset is not None]
NIBBLE_IDS = [f.name for f in NIBBLE_FORMATS]


def test_the_nibble_formats_are_the_kernels():
    """The twin factors exactly the formats the GEMV kernel factors (gemv_quant.cu's
    Format::NIBBLES: q4_0, q4_1, q4_k)."""
    assert NIBBLE_IDS == ["Q4_0", "Q4_1", "Q4_K"]


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_fields_are_the_integer_form_of_the_decode(fmt):
    """A format's fields (q, a, b per sub-block) are int8 codes and float32 steps and mins with which fl32(a * q + b) is the decode bit for bit (zero's sign
    included), and a nibble format's factored view (codes 0..15, b - offset * a) gives the same
    values."""
    raw = random_raw(fmt, 24, fmt.block_elements * 4, seed=5)
    weight = QuantizedWeight.from_raw(fmt, (24, fmt.block_elements * 4), raw, "w")
    blocks = fmt.blocks(raw, weight.shape)
    q, a, b = fmt.fields(blocks)
    assert q.dtype == np.int8 and a.dtype == b.dtype == np.float32 and a.shape == b.shape == q.shape[:2]
    assert q.shape[1] * q.shape[2] == fmt.block_elements
    values = a[:, :, None] * q.astype(np.float32) + b[:, :, None]
    np.testing.assert_array_equal(values.reshape(weight.shape).view(np.uint32), weight.dequantize().view(np.uint32))
    if fmt.nibble_offset is not None:
        codes, fa, fb = affine_blocks(weight)
        assert codes.dtype == np.uint8 and codes.max() <= 15
        factored = fa[:, :, None] * codes.astype(np.float32) + fb[:, :, None]
        np.testing.assert_array_equal(factored.reshape(weight.shape), weight.dequantize())


@pytest.mark.parametrize("fmt", NIBBLE_FORMATS, ids=NIBBLE_IDS)
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_factored_linear_is_the_exact_product_within_its_float32_bound(fmt, seed):
    """The decode GEMV's twin of a nibble format (w = a c + b factored out of each block's dot
    product, no weight rounded) against the exact float64 product of the exact block values and
    bf16(X): within factored_error_bound (L roundings of at most 2^-23 of the total of the terms
    |a| (128 + c) |x| and |b - 128 a| |x|). With random fp16 scales and mins (subnormal, zero and
    30x among them) and k up to 2,048."""
    rng = np.random.default_rng(seed)
    k = fmt.block_elements * int(rng.integers(1, 9))
    raw = random_raw(fmt, 40, k, seed=seed)
    qweight = QuantizedWeight.from_raw(fmt, (40, k), raw, "w")
    x32 = (rng.standard_normal((GEMV_MAX_ROWS, k)) * rng.choice([1.0, 1e-3, 50.0], (GEMV_MAX_ROWS, 1))).astype(np.float32)
    x = x32.astype(BF16).astype(np.float64)
    exact = x @ exact_dequantize(fmt, raw, (40, k)).T
    twin = linear_factored(x32, qweight)
    assert twin.dtype == np.float32 and twin.shape == (GEMV_MAX_ROWS, 40)
    bound = factored_error_bound(x32, qweight)
    assert (np.abs(twin - exact) <= bound).all()
    np.testing.assert_array_equal(linear(x32, qweight), twin)        # m <= 8: the GEMV's twin


@pytest.mark.parametrize("fmt", NIBBLE_FORMATS, ids=NIBBLE_IDS)
def test_factored_linear_against_the_dequantizing_one(fmt):
    """The factored twin and the dequantizing one differ by the bf16 rounding of every weight
    (at most 2^-9 |w| each: sum 2^-9 |w| |x|) plus each one's float32 error: the dequantizing
    sum's gamma_k sum |x w_bf16| (|w_bf16| <= (1 + 2^-8) |w|) and factored_error_bound. Above
    GEMV_MAX_ROWS rows linear() is the dequantizing twin (prefill's dequantize-then-GEMM)."""
    k = fmt.block_elements * 8
    raw = random_raw(fmt, 64, k, seed=21)
    qweight = QuantizedWeight.from_raw(fmt, (64, k), raw, "w")
    x32 = np.random.default_rng(22).standard_normal((GEMV_MAX_ROWS + 1, k)).astype(np.float32)
    x = np.abs(x32.astype(BF16).astype(np.float64))
    w = np.abs(exact_dequantize(fmt, raw, (64, k)))
    rounding = 2.0 ** -9 * (x @ w.T) + gamma(k, U32) * (1 + 2.0 ** -8) * (x @ w.T)
    new, old = linear_factored(x32, qweight), linear_dequantized(x32, qweight)
    assert (np.abs(new - old) <= rounding + factored_error_bound(x32, qweight)).all()
    assert not np.array_equal(new, old)                       # the weights' bf16 rounding is gone
    np.testing.assert_array_equal(linear(x32, qweight), old)
    np.testing.assert_array_equal(linear(x32[:GEMV_MAX_ROWS], qweight), new[:GEMV_MAX_ROWS])


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_row_permutation_of_blocks_commutes_with_dequantization(fmt):
    """llama.cpp's q/k row order is undone on whole rows, so on the blocks as well."""
    shape = (64, fmt.block_elements * 2)
    raw = random_raw(fmt, *shape, seed=7)
    np.testing.assert_array_equal(fmt.dequantize(unpermute_rope_rows(raw, 4), shape),
                                  unpermute_rope_rows(fmt.dequantize(raw, shape), 4))


def test_a_non_finite_scale_is_a_model_load_error_naming_the_block():
    fmt = BLOCK_FORMATS["Q4_1"]
    raw = random_raw(fmt, 2, 64, seed=8)
    raw.reshape(-1, fmt.block_bytes)[3, 2:4] = np.array([np.inf], "<f2").view(np.uint8)
    with pytest.raises(ModelLoadError, match=r"'blk.0.attn_q.weight'.*Q4_1 block 3 has a non-finite"):
        QuantizedWeight.from_raw(fmt, (2, 64), raw, "blk.0.attn_q.weight")


def test_a_wrong_size_or_partial_block_is_a_model_load_error():
    fmt = BLOCK_FORMATS["Q4_K"]
    with pytest.raises(ModelLoadError, match="takes 288 bytes, the file holds 287"):
        QuantizedWeight.from_raw(fmt, (2, 256), np.zeros(287, np.uint8), "w")
    with pytest.raises(ModelLoadError, match="not whole blocks of 256"):
        QuantizedWeight.from_raw(fmt, (2, 128), np.zeros(144, np.uint8), "w")


def write_file(path, tensors: dict[str, tuple[np.ndarray, str]]):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (w, kind) in tensors.items():
        if kind in ("F32", "F16"):
            writer.add_tensor(name, w.astype(np.float32 if kind == "F32" else np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_written_file_reads_back_as_blocks_and_arrays(tmp_path):
    rng = np.random.default_rng(9)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    kinds = ("Q8_0", "Q4_0", "Q4_1", "F32", "F16")
    path = write_file(tmp_path / "m.gguf", {f"t.{k}": (w, k) for k in kinds})
    weights = read_gguf_weights(path)
    for kind in kinds[:3]:
        q = weights[f"t.{kind}"]
        assert q.format.name == kind and q.shape == (8, 64) and q.nbytes == 8 * 2 * q.format.block_bytes
        np.testing.assert_array_equal(q.blocks.reshape(-1), gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]).reshape(-1))
    np.testing.assert_array_equal(weights["t.F32"], w)
    np.testing.assert_array_equal(weights["t.F16"], w.astype(np.float16))


def test_an_unsupported_block_type_is_one_error_naming_it(tmp_path):
    w = np.ones((4, 32), np.float32)
    path = write_file(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (w, "Q5_0")})
    with pytest.raises(ModelLoadError, match=r"'blk.0.ffn_up.weight' has type Q5_0; tinyvllm keeps Q8_0"):
        read_gguf_weights(path)
