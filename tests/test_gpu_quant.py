"""Quantized weights on the GPU (cuda/gemv_quant.cu, gpu/ops/quant_gemv.py) against their numpy twins.

Kernels, on fresh random weights of every kind (FP8 per-channel codes; GGUF Q8_0 / Q4_0 / Q4_1 /
Q4_K / Q6_K blocks with random quants, sub-block scales and mins, and finite fp16 scales and mins:
normal, subnormal, zero, negative; EXPANDED: a fused group of parts in different GGUF formats):
  * gemv_quant_<kind> vs the kind's twin linear (quant/fp8.py: fl32(bf16(X) . q) * scale;
    quant/block_format.py: bf16(X) @ bf16(dequant(W))^T), both sums of the same exact products
    (bf16 x bf16 is exact in fp32), in different orders. Q4_0 / Q4_1 / Q4_K instead against the
    factored twin (block_format.linear_factored: each block's affine map applied to its sum of
    raw-code products), elementwise within twice factored_error_bound (_close). The others' tolerance,
    relative (Frobenius):
      fp32 Y: FP32_TOL = 1e-4, the bf16 GEMV's (test_gpu_gemv.py): reordering K <= 8192 fp32 sums
              of random-signed terms moves the result by ~sqrt(K) * 2^-24 of its terms' scale;
      bf16 Y: that plus 2^-8, the bf16 rounding of each output (8 significant bits: relative error
              at most 2^-8 per element, so at most 2^-8 in the Frobenius norm).
    Y sits between poisoned guard rows that must keep their bits; X carries a NaN row past m.
  * dequant_<kind> (prefill's dequantization) equals its twin bit for bit (planes_dequantize_bf16
    for the GGUF kinds, fp8_scaled_bf16 for FP8): every step is exact or one fmaf/fmul/RNE rounding
    the twin makes the same way; rows past the requested range stay poisoned.
  * quant_linear() at m > 8: the dequantize-then-cuBLAS path (the scratch) and the GEMV over X's rows
    8 at a time (no scratch), against the same twins.
  * the fused decode layer's kernels on quantized weights (gemv.cu's epilogues, gemv_common.cuh):
    the residual GEMV handing the norm over and the LM head on it against the twins, the RoPE +
    KV-write and SwiGLU / GeGLU epilogues bit for bit against their chains.
Whole model: the tiny preset with --quantization fp8, a tiny GGUF Q4_1 file and a tiny Q4_K_M-like
one (Q4_K, Q6_K, layer 0's q/k/v mixed: EXPANDED) on the CUDA runner
against the numpy reference on the same weights (tests/gpu_helpers.py's logits_match_reference), on
the fused decode layer and on the nine-launch one.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyvllm.quant import fp8, weight_kinds
from tinyvllm.quant.block_format import (
    BF16,
    QuantizedWeight,
    factored_error_bound,
    linear_factored,
)
from tinyvllm.quant.gguf_kquants import Q4_K, Q6_K
from tinyvllm.quant.gguf_legacy import Q4_0, Q4_1, Q8_0

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-4
BF16_TOL = 2.0**-8 + FP32_TOL
KINDS = ["FP8", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "EXPANDED"]
FORMATS = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q4_K": Q4_K, "Q6_K": Q6_K}
# SmolLM2-135M's projections (qkv, o, gate_up, down, tied head) and Llama-1B's down, then tails:
# n not a multiple of 16, k not a multiple of a step (FP8/Q8_0/Q6_K: 64, Q4: 128) nor of the k-split
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (2048, 8192), (37, 96), (130, 160)]
SUPER_BLOCK = 256


def _k(kind: str, k: int) -> int:
    """k for `kind`: the K-quants' rows are whole super-blocks of 256, so k rounds up to one
    (576 -> 768, 96 and 160 -> 256: one and two steps of a Q4_K lane set, four of Q6_K's)."""
    return -(-k // SUPER_BLOCK) * SUPER_BLOCK if kind in ("Q4_K", "Q6_K") else k


def _weight(kind: str, n: int, k: int, rng):
    """A fresh random weight of `kind` [n, k] and its device planes (gpu_helpers.DeviceArray each)."""
    from gpu_helpers import DeviceArray
    from test_quant_gguf import random_raw

    from tinyvllm.gpu.quant_weights import pack_planes
    from tinyvllm.quant.weight_kinds import RowStack

    def blocks(fmt, rows):
        return QuantizedWeight.from_raw(fmt, (rows, k), random_raw(fmt, rows, k, int(rng.integers(1 << 31))), "w")

    if kind == "FP8":
        w = fp8.quantize_per_channel(rng.standard_normal((n, k), dtype=np.float32) / np.float32(math.sqrt(k)))
    elif kind == "EXPANDED":    # three parts (q, k, v of a Q4_K_M file where k allows: whole super-blocks)
        formats = (Q4_K, Q4_K, Q6_K) if k % SUPER_BLOCK == 0 else (Q4_1, Q8_0, Q4_0)
        cuts = [0, n // 2, n // 2 + n // 4, n]
        w = RowStack(tuple(blocks(f, b - a) for f, a, b in zip(formats, cuts, cuts[1:]) if b > a))
    else:
        w = blocks(FORMATS[kind], n)
    got_kind, quants, scales = pack_planes(w)
    assert got_kind == kind
    return w, DeviceArray(quants), DeviceArray(scales)


def _matrix(kind, n, k, d_q, d_s):
    from tinyvllm.gpu.quant_weights import QuantMatrix
    return QuantMatrix(kind, d_q.ptr, d_s.ptr, n, k, d_q.host.nbytes + d_s.host.nbytes)


def _twin(w, x: np.ndarray) -> np.ndarray:
    """The kind's twin linear (a RowStack: its parts' twins side by side)."""
    return weight_kinds.linear(x, w)


def _guarded_y(m: int, n: int, out_dtype: str, y0):
    """A poisoned [m + 2, n] buffer (guard row, Y, guard row); Y = y0 where given."""
    from gpu_helpers import POISON, DeviceArray
    dtype = BF16 if out_dtype == "bfloat16" else np.dtype(np.float32)
    pattern = POISON[dtype]
    buf = np.full((m + 2, n), pattern, pattern.dtype).view(dtype)
    if y0 is not None:
        buf[1:m + 1] = y0.astype(dtype)
    return buf, DeviceArray(buf), dtype


def _factored(w) -> bool:
    """A weight whose GEMV factors each block's affine map (block_format.linear_factored)."""
    return isinstance(w, QuantizedWeight) and w.format.nibble_offset is not None


def _close(got, want, out_dtype, w=None, x=None, scale=1.0) -> None:
    """got against the twin's want. A factored kind's GEMV (w, x given) and its twin are two fp32
    evaluations of one formula: elementwise within twice factored_error_bound (times `scale`,
    the head's inv_rms), plus 2^-23 |want| for an accumulate's or a scale's own rounding, plus a
    bf16 output's rounding (2^-9 of |got| <= |want| + that bound; 2^-8 kept for margin). Any other
    kind: the relative Frobenius tolerances (FP32_TOL, BF16_TOL)."""
    from gpu_helpers import rel_err
    got = np.asarray(got, np.float32)
    if w is not None and _factored(w) and x is not None:
        bound = 2 * scale * factored_error_bound(np.asarray(x, np.float32), w) + 2.0**-23 * np.abs(want)
        if out_dtype == "bfloat16":
            bound = bound + 2.0**-8 * (np.abs(want) + bound)
        assert (np.abs(got - want) <= bound).all(), np.max(np.abs(got - want) / np.maximum(bound, 1e-30))
    else:
        assert rel_err(got, want) < (BF16_TOL if out_dtype == "bfloat16" else FP32_TOL)


def _check(d_y, buf, m, want, out_dtype, w=None, x=None):
    import pycuda.driver as drv
    drv.Context.synchronize()
    got = d_y.get()
    np.testing.assert_array_equal(np.stack([got[0], got[m + 1]]).view(np.uint8),
                                  np.stack([buf[0], buf[m + 1]]).view(np.uint8), err_msg="wrote outside Y[0:m]")
    _close(got[1:m + 1], want, out_dtype, w, x)


def _x(rng, m, k):
    """bf16 X [m, k] on the device, with a NaN row after it; and its host copy."""
    from gpu_helpers import DeviceArray, to_bf16
    x = to_bf16(rng.standard_normal((m, k)))
    return x, DeviceArray(np.concatenate([x, np.full((1, k), np.nan, np.float32).astype(BF16)]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_quant(gpu_ops, rng, kind, n, k):
    """Every m of a decode batch, store and accumulate, bf16 and fp32 Y, on one weight per shape."""
    k = _k(kind, k)
    w, d_q, d_s = _weight(kind, n, k, rng)
    matrix = _matrix(kind, n, k, d_q, d_s)
    for m in (1, 3, 8):
        for accumulate in (False, True):
            for out_dtype in ("bfloat16", "float32"):
                x, d_x = _x(rng, m, k)
                y0 = rng.standard_normal((m, n)).astype(np.float32) if accumulate else None
                buf, d_y, dtype = _guarded_y(m, n, out_dtype, y0)
                gpu_ops.gemv(d_y.ptr + n * dtype.itemsize, d_x, matrix, m, n, k, accumulate=accumulate,
                             out_dtype=out_dtype)
                want = _twin(w, x.astype(np.float32))
                if accumulate:
                    want = want + buf[1:m + 1].astype(np.float32)
                _check(d_y, buf, m, want, out_dtype, w, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k_warps", [1, 3, 16])
def test_gemv_quant_split_k(gpu_ops, rng, kind, k_warps):
    """Any k-split (warps with no step, warps with many ring refills) gives the twin's result."""
    w, d_q, d_s = _weight(kind, 130, 1536, rng)
    x, d_x = _x(rng, 5, 1536)
    buf, d_y, _ = _guarded_y(5, 130, "float32", None)
    gpu_ops.gemv(d_y.ptr + 130 * 4, d_x, _matrix(kind, 130, 1536, d_q, d_s), 5, 130, 1536, out_dtype="float32",
                 k_warps=k_warps)
    _check(d_y, buf, 5, _twin(w, x.astype(np.float32)), "float32", w, x)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize(gpu_ops, rng, kind):
    """Rows row0 .. row0 + rows of W as bf16, bit for bit the twin's; the rows after stay poisoned."""
    from gpu_helpers import DeviceArray

    from tinyvllm.gpu.quant_weights import fp8_scaled_bf16, planes_dequantize_bf16
    n, k, row0, rows = 300, _k(kind, 544), 17, 250
    w, d_q, d_s = _weight(kind, n, k, rng)
    out = DeviceArray.poisoned((rows + 1, k), BF16)
    gpu_ops.dequantize(out, _matrix(kind, n, k, d_q, d_s), row0, rows)
    import pycuda.driver as drv
    drv.Context.synchronize()
    got = out.get()
    full = (fp8_scaled_bf16 if kind == "FP8" else lambda q, s, r, c: planes_dequantize_bf16(kind, q, s, r, c))(
        d_q.host, d_s.host, n, k)
    np.testing.assert_array_equal(got[:rows].view(np.uint16), full[row0:row0 + rows].view(np.uint16))
    assert np.all(got[rows].view(np.uint16) == 0x7FC0), "wrote past the rows asked for"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scratch", [True, False], ids=["dequant-cublas", "gemv-chunks"])
def test_quant_linear_large_m(gpu_ops, rng, kind, scratch):
    """m > 8 (prefill): dequantize into the scratch then cuBLAS, or, for a matrix past the scratch,
    the GEMV 8 rows of X at a time; accumulate into fp32 Y. FP8 through the scratch multiplies
    each code by its scale before the bf16 rounding (fp8_scaled_bf16), so its twin here is
    bf16(X) @ that^T."""
    from gpu_helpers import DeviceArray

    from tinyvllm.gpu.quant_weights import fp8_scaled_bf16
    m, n, k = 37, 200, _k(kind, 576)
    w, d_q, d_s = _weight(kind, n, k, rng)
    scratch_buf = DeviceArray.poisoned((n * k,), BF16) if scratch else None
    gpu_ops.use_dequant_scratch(scratch_buf.ptr if scratch else 0, n * k if scratch else 0)
    try:
        x, d_x = _x(rng, m, k)
        y0 = rng.standard_normal((m, n)).astype(np.float32)
        buf, d_y, _ = _guarded_y(m, n, "float32", y0)
        gpu_ops.quant_linear(d_y.ptr + n * 4, d_x, _matrix(kind, n, k, d_q, d_s), m, n, k, accumulate=True,
                             out_dtype="float32")
        if kind == "FP8" and scratch:
            want = x.astype(np.float32) @ fp8_scaled_bf16(d_q.host, d_s.host, n, k).astype(np.float32).T
        elif scratch or not _factored(w):
            want = _twin(w, x.astype(np.float32))
        else:    # the GEMV over X's rows 8 at a time: the factored twin on each chunk
            want = np.concatenate([linear_factored(x[r:r + 8].astype(np.float32), w) for r in range(0, m, 8)])
        _check(d_y, buf, m, want + y0, "float32", *((w, x) if not scratch else ()))
    finally:
        gpu_ops.use_dequant_scratch(0, 0)


def test_launch_shapes_fit(gpu_ops):
    """Every kind's launch at every shape above stays within a CTA's 227 KB of shared memory."""
    from tinyvllm.gpu.ops.quant_gemv import quant_gemv_shape
    from tinyvllm.gpu.quant_weights import QuantMatrix
    for kind in KINDS:
        for n, k in SHAPES:
            k = _k(kind, k)
            kw = gpu_ops.quant_k_warps(QuantMatrix(kind, 0, 0, n, k, 0))
            grid, block, shared = quant_gemv_shape(kind, n, kw)
            assert grid[0] * 16 >= n and block[0] == 32 * kw and shared <= 227 << 10


# ---- the fused decode layer's kernels on quantized weights ---------------------------------------
# Each is gemv.cu's epilogue (gemv_common.cuh) fed this kernel's sums, so each is held to the same
# checks as its bf16 namesake (tests/test_gpu_fused.py, tests/test_gpu_families.py): the norm's
# producer and the head against the twins, the RoPE and SwiGLU epilogues bit for bit against their
# chains of already tested kernels (the same sums, then the same arithmetic on the stored product).

FUSED_SHAPES = [(576, 9, 3, 64, 1536), (1024, 8, 2, 128, 2816)]     # k = hidden, q/kv heads, head_dim, inter
EPS = 1e-5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k,inner", [(576, 1536), (1024, 2816)])
def test_quant_residual_norm(gpu_ops, rng, kind, k, inner):
    """gemv_residual_norm() on a quantized W (o / down into the residual stream): hidden equals
    gemv() with accumulate bit for bit (the same sums, the same add) and the twin within the bf16
    bound; normed = bf16(hidden * norm_w) bit for bit; each CTA's sum of its 16 columns' squares
    within 4 u of float64 (a 16-term fp32 sum of exact squares)."""
    import pycuda.driver as drv
    from gpu_helpers import DeviceArray, to_bf16
    from test_gpu_fused import _bits, _norm_weight
    for m in (1, 5, 8):
        w, d_q, d_s = _weight(kind, k, inner, rng)
        matrix = _matrix(kind, k, inner, d_q, d_s)
        x, d_x = _x(rng, m, inner)
        h0 = to_bf16(rng.standard_normal((m, k)) * rng.uniform(0.1, 30))
        hidden, reference = DeviceArray(h0), DeviceArray(h0)
        norm_w, d_nw = _norm_weight(rng, k)
        normed = DeviceArray.poisoned((m + 1, k), BF16)
        row_ss = DeviceArray.poisoned((m + 1, k // 16), np.float32)
        gpu_ops.gemv_residual_norm(hidden, d_x, matrix, m, k, inner, d_nw, normed, row_ss)
        gpu_ops.gemv(reference, d_x, matrix, m, k, inner, accumulate=True)
        drv.Context.synchronize()
        got = hidden.get()
        np.testing.assert_array_equal(_bits(got), _bits(reference.get()), err_msg="hidden != gemv(accumulate)")
        _close(got, _twin(w, x.astype(np.float32)) + h0.astype(np.float32), "bfloat16", w, x)
        got32 = got.astype(np.float32)
        np.testing.assert_array_equal(_bits(normed.get()[:m]), _bits((got32 * norm_w.astype(np.float32)).astype(BF16)))
        squares = (got32.astype(np.float64) ** 2).reshape(m, k // 16, 16).sum(axis=2)
        np.testing.assert_allclose(row_ss.get()[:m], squares, rtol=4 * 2.0**-24, atol=0)
        assert np.all(_bits(normed.get()[m]) == 0x7FC0) and np.all(np.isnan(row_ss.get()[m])), "wrote past row m"


@pytest.mark.parametrize("kind", KINDS)
def test_quant_prenormed_head(gpu_ops, rng, kind):
    """The LM head on the handed-over final norm with a quantized W (a tied quantized table):
    Y = inv_rms * twin(normed), fp32 (with the greedy argmax keys of exactly the logits stored) and
    bf16; inv_rms from the producer's fp32 row sums with fast rsqrt and division (a few ulp, inside
    FP32_TOL)."""
    import pycuda.driver as drv
    from gpu_helpers import DeviceArray
    from test_gpu_fused import _handed_over

    from tinyvllm.reference import kernels as ref
    from tinyvllm.reference.sampling import head_argmax_keys
    n, k = 3000, _k(kind, 576)
    w, d_q, d_s = _weight(kind, n, k, rng)
    matrix = _matrix(kind, n, k, d_q, d_s)
    for m in (1, 4, 8):
        stored, norm_w, normed, row_ss = _handed_over(gpu_ops, rng, m, k, None)
        x64 = stored.astype(np.float64)
        inv_rms = 1 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS)
        operand = ref.rms_norm_operand(stored, norm_w).astype(np.float32)
        want = inv_rms * _twin(w, operand)
        for out_dtype, dtype in (("float32", np.float32), ("bfloat16", BF16)):
            y = DeviceArray.poisoned((m + 1, n), dtype)
            keys = DeviceArray(np.zeros(m + 1, np.uint64))
            fp32 = out_dtype == "float32"
            gpu_ops.gemv(y, normed, matrix, m, n, k, out_dtype=out_dtype, last=True, prenormed=(row_ss, EPS),
                         head_argmax=keys if fp32 else 0)
            drv.Context.synchronize()
            got = y.get().astype(np.float32)
            assert np.all(np.isnan(got[m])), "wrote past row m"
            _close(got[:m], want, out_dtype, w, operand, scale=inv_rms)
            if fp32:
                np.testing.assert_array_equal(keys.get()[:m], head_argmax_keys(got[:m]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k,hq,hkv,d,inter", FUSED_SHAPES)
def test_quant_fused_epilogues_equal_their_chains(gpu_ops, rng, kind, k, hq, hkv, d, inter):
    """gemv_rope_kv() (with and without Qwen2's biases) and gemv_silu_mul() (SwiGLU and GeGLU) on a
    quantized W equal, bit for bit, the prenormed GEMV on that W (its product stored in bf16)
    followed by rope_write_kv() / silu_mul(): the epilogue reads the same sums rounded the same way."""
    k = _k(kind, k)
    import pycuda.driver as drv
    from gpu_helpers import DeviceArray, to_bf16
    from test_gpu_families import _freqs
    from test_gpu_fused import _bits, _handed_over
    m = 5
    _, _, normed, row_ss = _handed_over(gpu_ops, rng, m, k, None)
    n = (hq + 2 * hkv) * d
    _, d_q, d_s = _weight(kind, n, k, rng)
    qkv_w = _matrix(kind, n, k, d_q, d_s)
    positions = rng.integers(0, 131072, m).astype(np.int32)
    slots = rng.permutation(64)[:m].astype(np.int32)
    slots[1] = -1
    rope_in = [DeviceArray(a) for a in (positions, slots, _freqs(d))]
    bias = DeviceArray(to_bf16(rng.standard_normal(n)))
    for with_bias in (False, True):
        out = {}
        for path in ("fused", "chain"):
            qkv = DeviceArray.poisoned((m + 1, n), BF16)
            caches = [DeviceArray.poisoned((64, hkv, d), BF16) for _ in range(2)]
            if path == "fused":
                gpu_ops.gemv_rope_kv(qkv, normed, qkv_w, m, n, k, *caches, *rope_in, num_q_heads=hq, num_kv_heads=hkv,
                                     head_dim=d, prenormed=(row_ss, EPS), bias=bias if with_bias else 0)
            else:
                gpu_ops.gemv(qkv, normed, qkv_w, m, n, k, prenormed=(row_ss, EPS))
                gpu_ops.rope_write_kv(qkv, *caches, *rope_in, m, hq, hkv, d, bias=bias if with_bias else 0)
            drv.Context.synchronize()
            out[path] = [qkv.get(), *(c.get() for c in caches)]
        (f_qkv, *f_caches), (c_qkv, *c_caches) = out["fused"], out["chain"]
        np.testing.assert_array_equal(_bits(f_qkv[:, :hq * d]), _bits(c_qkv[:, :hq * d]), err_msg="q")
        for name, a, b in zip(("k cache", "v cache"), f_caches, c_caches):
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)
        assert np.all(_bits(f_qkv[m]) == 0x7FC0), "wrote past row m"
    _, d_q, d_s = _weight(kind, 2 * inter, k, rng)
    gate_up_w = _matrix(kind, 2 * inter, k, d_q, d_s)
    for gelu_tanh in (False, True):
        act, gate_up, chain = (DeviceArray.poisoned((m + 1, width), BF16) for width in (inter, 2 * inter, inter))
        gpu_ops.gemv_silu_mul(act, normed, gate_up_w, m, 2 * inter, k, prenormed=(row_ss, EPS), gelu_tanh=gelu_tanh)
        gpu_ops.gemv(gate_up, normed, gate_up_w, m, 2 * inter, k, prenormed=(row_ss, EPS))
        gpu_ops.silu_mul(chain, gate_up, m, inter, gelu_tanh=gelu_tanh)
        drv.Context.synchronize()
        got = act.get()
        np.testing.assert_array_equal(_bits(got), _bits(chain.get()), err_msg="SwiGLU / GeGLU epilogue != its chain")
        assert np.all(_bits(got[m]) == 0x7FC0) and not np.any(_bits(got[:m]) == 0x7FC0)


# ---- whole model -----------------------------------------------------------------------------

BF16_NOISE_RATIO, STEP_NOISE_RATIO, BLOCK = 1.5, 2.0, 16   # test_gpu_model.py's bounds


def _runner(cfg, weights):
    from tinyvllm.config import EngineConfig
    from tinyvllm.gpu.cuda_runner import CudaRunner
    return CudaRunner(cfg, weights, EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, num_kv_blocks=128,
                                                 block_size=BLOCK, max_model_len=2048))


def _matches_reference(cfg, weights, kinds: dict | None = None):
    """The runner on `weights` against the numpy reference on the same weights, its decode steps on
    the fused layer (the default, quantized kernels included) and on the nine-launch one. kinds:
    {(layer, projection): device kind} the upload must hold ("lm_head" for the head)."""
    from gpu_helpers import decode_layer, logits_match_reference

    from tinyvllm.reference.model import ReferenceModel
    runner = _runner(cfg, weights)
    try:
        assert runner.weights.quantized
        w = runner.weights
        for where, kind in (kinds or {}).items():
            matrix = w.lm_head if where == "lm_head" else getattr(w.layers[where[0]], where[1])
            assert matrix.kind == kind, (where, matrix)
        for fused in (True, False):
            with decode_layer(runner, fused):
                logits_match_reference(cfg, runner, ReferenceModel(cfg, weights, round_bf16=True),
                                       ReferenceModel(cfg, weights), BLOCK, BF16_NOISE_RATIO, STEP_NOISE_RATIO)
    finally:
        runner.close()


def test_tiny_model_fp8_matches_reference(tiny_model_dir):
    """--quantization fp8 (every layer linear per-channel FP8; embedding and head bf16) on the GPU
    against the numpy reference on the same FP8 weights. Prefill reads bf16(q * scale) where the
    reference (and decode) scale the sum: one more rounding per weight, of the size bf16 weights
    carry in the bf16 model this test's bounds come from."""
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    _matches_reference(cfg, load_weights(tiny_model_dir, cfg, "fp8"))


def test_tiny_gguf_q4_1_matches_reference(tmp_path, monkeypatch):
    """A tiny Llama GGUF file in Q4_1 (every matrix, the tied embedding too: its gather reads the
    dequantized bf16 table, the head the blocks) on the GPU against the numpy reference on the same
    blocks. head_dim 64: the attention kernels' smallest."""
    pytest.importorskip("gguf")
    from gguf_helpers import tiny_hf_config, tiny_hf_weights, tiny_vocab, write_gguf

    from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks
    from tinyvllm.config import ModelConfig
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path / "home"))
    tokens, _, _ = tiny_vocab()
    hf = tiny_hf_config(len(tokens), hidden_size=128, intermediate_size=256, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64, max_position_embeddings=2048)
    path = write_gguf(tmp_path / "tiny-q4_1.gguf", hf, tiny_hf_weights(hf), qtype="Q4_1")
    cfg = ModelConfig.from_pretrained(gguf_model_dir(path))
    weights = load_gguf_blocks(path, cfg)
    assert {w.format.name for w in weights.values() if isinstance(w, QuantizedWeight)} == {"Q4_1"}
    _matches_reference(cfg, weights)


def test_tiny_gguf_q4_k_m_matches_reference(tmp_path, monkeypatch):
    """A tiny Llama GGUF file laid out as a Q4_K_M one (test_quant_gpu_layout.write_q4_k_m_gguf: Q4_K
    matrices and embedding, a Q6_K head and layer-0 down, layer 0's q/k/v Q4_K + Q4_K + Q6_K, so one
    EXPANDED matrix under the fused qkv + RoPE + KV-write epilogue) on the GPU against the numpy
    reference on the same blocks."""
    pytest.importorskip("gguf")
    from test_quant_gpu_layout import write_q4_k_m_gguf

    from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks
    from tinyvllm.config import ModelConfig
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path / "home"))
    path = write_q4_k_m_gguf(tmp_path / "tiny-q4_k_m.gguf")
    cfg = ModelConfig.from_pretrained(gguf_model_dir(path))
    weights = load_gguf_blocks(path, cfg)
    _matches_reference(cfg, weights, {(0, "qkv"): "EXPANDED", (1, "qkv"): "Q4_K", (0, "down"): "Q6_K",
                                      (1, "gate_up"): "Q4_K", "lm_head": "Q6_K"})


def test_engine_serves_fp8_on_cuda(tiny_model_dir):
    """LLM(..., device="cuda", quantization="fp8") starts (no refusal), holds FP8 matrices on the
    device and generates."""
    from tinyvllm import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), device="cuda", quantization="fp8", kv_cache_gb=0.25, max_model_len=256)
    try:
        assert llm.engine.runner.weights.quantized
        out = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 4
    finally:
        llm.engine.close()
