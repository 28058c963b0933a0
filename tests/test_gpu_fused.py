"""The fused decode layer's kernels (cuda/gemv.cu: gemv_[norm_]rope_kv_bf16,
gemv_[norm_]silu_mul_bf16, and gemv_bf16 / embedding_gather with ss_out) against the unfused
kernel chains they replace and against numpy.

1. Chunk sums (new quantity): ss_out[r, c] of gemv_bf16 and embedding_gather against the sum of
   squares of the stored row's columns 16c .. 16c + 15 in float64. 16 non-negative terms, each
   square rounded once and four levels of fp32 additions: |ss - exact| <= ((1 + u)^5 - 1) exact
   < 5.01 u exact, u = 2^-24.
2. Bitwise: each fused kernel's outputs equal, bit for bit, those of the chain it replaces run
   on the GPU — rms_norm(), gemv() (same k_warps: the split of K fixes each dot product's
   summation order), then rope_write_kv() or silu_mul() — with the norm's chunk sums produced
   the way the model produces them (the o/down GEMV's or the embedding's ss_out). common.cuh
   gives both sides the same arithmetic, so any difference is a bug, not rounding; each kernel
   of the chain is held to its numpy twin in test_gpu_kernels.py / test_gpu_gemv.py, and the
   chain's projection is checked against its twin here too (bound in _check_twin).
3. Nothing written outside the outputs: outputs and caches start poisoned, guard rows / unused
   cache slots must keep their bits; inputs carry NaN past their valid rows.
Inputs are drawn fresh each run (seeds printed by the rng fixture).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyvllm.reference import kernels as ref

pytestmark = pytest.mark.gpu

EPS = 1e-5
U = 2.0 ** -24
# (hidden k, intermediate): 1B, SmolLM2-135M, tiny, k not a multiple of 16 (a half chunk), k = 8
SILU_SHAPES = [(2048, 8192), (576, 1536), (256, 768), (264, 136), (8, 16)]
# (hidden k, q heads, kv heads, head_dim): 1B, SmolLM2-135M, head_dim 128, a half chunk, one head
ROPE_SHAPES = [(2048, 32, 8, 64), (576, 9, 3, 64), (256, 4, 2, 128), (264, 2, 1, 64), (64, 1, 1, 16)]


@pytest.fixture(scope="module")
def gpu(gpu_ops):
    return gpu_ops


def _sync():
    import pycuda.driver as drv
    drv.Context.synchronize()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _with_nan_rows(a: np.ndarray, rows: int = 1) -> np.ndarray:
    from gpu_helpers import BF16
    return np.concatenate([a, np.full((rows, *a.shape[1:]), np.nan, np.float32).astype(BF16)])


def _chunk_sums(rows: np.ndarray) -> np.ndarray:
    """float64 sum of squares of each row's 16-column chunks (missing columns 0)."""
    r = np.asarray(rows, np.float64)
    pad = -r.shape[1] % 16
    r = np.pad(r, ((0, 0), (0, pad)))
    return (r * r).reshape(r.shape[0], -1, 16).sum(axis=2)


def _check_chunk_sums(got: np.ndarray, stored_rows: np.ndarray) -> None:
    want = _chunk_sums(stored_rows)
    assert got.shape == want.shape
    worst = float(np.max(np.abs(got.astype(np.float64) - want) / np.maximum(5.01 * U * want, 1e-300)))
    print(f"[chunk-sums] worst |ss - exact| / (5.01 u exact) = {worst:.3f}")
    assert worst <= 1.0


def _check_twin(got, operand, w32, want):
    """bf16 product of an fp32-accumulated GEMV against the twin: the operand may differ by one
    bf16 ulp (2^-7 relative) where the fp32 formulas round differently, both sides accumulate k
    products in fp32 (k 2^-24 of the sum of absolute products each), Y is rounded to bf16
    (2^-8 relative)."""
    k = operand.shape[-1]
    bound = (2.0 ** -7 + 2 * k * U) * (np.abs(operand) @ np.abs(w32).T)
    bound = bound + 2.0 ** -8 * (np.abs(want) + bound)
    got = got.astype(np.float32)
    assert np.all(np.isfinite(got))
    assert float(np.max(np.abs(got - want) / np.maximum(bound, 1e-30))) <= 1.0


def _weights(rng, n, k):
    from gpu_helpers import DeviceArray, to_bf16
    w = to_bf16(rng.standard_normal((n, k)) / math.sqrt(k))
    return w.astype(np.float32), DeviceArray(_with_nan_rows(w, 16))


def _residual(gpu, rng, m, k, producer):
    """The residual stream [m, k] and its chunk sums as the model makes them: the o/down GEMV's
    residual add with ss_out (hidden += x @ W^T), or the embedding gather. -> (device hidden,
    device ss, host hidden as stored)."""
    from gpu_helpers import DeviceArray, to_bf16
    ss = DeviceArray.poisoned((m, -(-k // 16)), np.float32)
    if producer == "embedding":
        vocab = 50
        table = to_bf16(rng.standard_normal((vocab, k)) * rng.uniform(0.1, 30))
        ids = rng.integers(0, vocab, m).astype(np.int32)
        ids[-1] = vocab + 3 if m > 2 else ids[-1]           # an invalid id: a zero row (chunk sums 0)
        hidden = DeviceArray.poisoned((m, k), table.dtype)
        gpu.embedding(hidden, DeviceArray(table), DeviceArray(ids), m, k, vocab, ss_out=ss)
    else:
        h0 = to_bf16(rng.standard_normal((m, k)) * rng.uniform(0.1, 30))
        inner = 3 * k
        x = DeviceArray(_with_nan_rows(to_bf16(rng.standard_normal((m, inner)))))
        _, d_w = _weights(rng, k, inner)
        hidden = DeviceArray(h0)
        gpu.gemv(hidden, x, d_w, m, k, inner, accumulate=True, ss_out=ss)
    _sync()
    stored = hidden.get()
    _check_chunk_sums(ss.get(), stored)
    return hidden, ss, stored


@pytest.mark.parametrize("producer", ["gemv", "embedding"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k", [2048, 576, 264, 8])
def test_chunk_sums(gpu, rng, k, m, producer):
    _residual(gpu, rng, m, k, producer)


def _norm_weight(rng, k):
    from gpu_helpers import DeviceArray, to_bf16
    norm_w = to_bf16(1 + 0.2 * rng.standard_normal(k))
    return norm_w, DeviceArray(np.concatenate([norm_w, np.full(8, np.nan, np.float32).astype(norm_w.dtype)]))


def _fused_x(gpu, hidden, d_nw, ss, m, k, norm_inside: bool, dtype):
    """(X, norm) of a fused GEMV: the residual stream with its norm inside the GEMV, or the
    separate rms_norm's output (the layout fuses_norm() picks for grids of many CTAs)."""
    from gpu_helpers import DeviceArray
    if norm_inside:
        return hidden, (d_nw, ss, EPS)
    normed = DeviceArray.poisoned((m, k), dtype)
    gpu.rms_norm(normed, hidden, d_nw, m, k, EPS)
    return normed, None


@pytest.mark.parametrize("norm_inside", [True, False], ids=["norm", "plain"])
@pytest.mark.parametrize("producer", ["gemv", "embedding"])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("k,inter", SILU_SHAPES, ids=lambda v: str(v))
def test_silu_mul(gpu, rng, k, inter, m, producer, norm_inside, k_warps=None):
    from gpu_helpers import DeviceArray
    hidden, ss, stored = _residual(gpu, rng, m, k, producer)
    norm_w, d_nw = _norm_weight(rng, k)
    w32, d_w = _weights(rng, 2 * inter, k)
    fused = DeviceArray.poisoned((m + 2, inter), stored.dtype)          # guard rows 0 and m + 1
    normed = DeviceArray.poisoned((m, k), stored.dtype)
    gate_up = DeviceArray.poisoned((m, 2 * inter), stored.dtype)
    act = DeviceArray.poisoned((m, inter), stored.dtype)
    x, norm = _fused_x(gpu, hidden, d_nw, ss, m, k, norm_inside, stored.dtype)
    gpu.gemv_silu_mul(fused.ptr + inter * 2, x, d_w, m, 2 * inter, k, norm=norm, k_warps=k_warps)
    gpu.rms_norm(normed, hidden, d_nw, m, k, EPS)
    gpu.gemv(gate_up, normed, d_w, m, 2 * inter, k, k_warps=k_warps)
    gpu.silu_mul(act, gate_up, m, inter)
    _sync()
    got = fused.get()
    np.testing.assert_array_equal(_bits(got[[0, -1]]), np.full((2, inter), 0x7FC0, np.uint16),
                                  err_msg="wrote outside act[0:m]")
    np.testing.assert_array_equal(_bits(got[1:-1]), _bits(act.get()), err_msg="fused != rms_norm, gemv, silu_mul")
    operand = ref.rms_norm_operand(stored, norm_w, EPS)
    _check_twin(gate_up.get(), operand, w32, ref.linear(operand, w32))


@pytest.mark.parametrize("k_warps", [1, 3, 8, 32])
@pytest.mark.parametrize("m,k,inter", [(1, 2048, 8192), (8, 576, 1536), (5, 264, 136)])
def test_silu_mul_split_k(gpu, rng, m, k, inter, k_warps):
    """Every split of K, including more warps than steps (warps that only take part in the
    epilogue)."""
    test_silu_mul(gpu, rng, k, inter, m, "gemv", True, k_warps=k_warps)
    test_silu_mul(gpu, rng, k, inter, m, "gemv", False, k_warps=k_warps)


@pytest.mark.parametrize("norm_inside", [True, False], ids=["norm", "plain"])
@pytest.mark.parametrize("producer", ["gemv", "embedding"])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("k,hq,hkv,d", ROPE_SHAPES, ids=lambda v: str(v))
def test_rope_kv(gpu, rng, k, hq, hkv, d, m, producer, norm_inside, k_warps=None):
    import dataclasses

    from gpu_helpers import DeviceArray

    from tinyvllm.checkpoint.model_writer import preset_config
    from tinyvllm.config import rope_inv_freq
    hidden, ss, stored = _residual(gpu, rng, m, k, producer)
    norm_w, d_nw = _norm_weight(rng, k)
    n = (hq + 2 * hkv) * d
    w32, d_w = _weights(rng, n, k)
    inv_freq = DeviceArray(rope_inv_freq(dataclasses.replace(preset_config("llama-3.2-1b"), head_dim=d)))
    positions = rng.integers(0, 131072, m).astype(np.int32)
    slots = rng.permutation(4 * 16)[:m].astype(np.int32)
    if m > 1:
        slots[1] = -1                                                     # a padding row: no cache write
    d_pos, d_slots = DeviceArray(positions), DeviceArray(slots)
    out = {}
    for path in ("fused", "chain"):
        qkv = DeviceArray.poisoned((m + 2, n), stored.dtype)
        caches = [DeviceArray.poisoned((4, 16, hkv, d), stored.dtype) for _ in range(2)]
        if path == "fused":
            x, norm = _fused_x(gpu, hidden, d_nw, ss, m, k, norm_inside, stored.dtype)
            gpu.gemv_rope_kv(qkv.ptr + n * 2, x, d_w, m, n, k, *caches, d_pos, d_slots, inv_freq,
                             num_q_heads=hq, num_kv_heads=hkv, head_dim=d, norm=norm, k_warps=k_warps)
        else:
            normed = DeviceArray.poisoned((m, k), stored.dtype)
            gpu.rms_norm(normed, hidden, d_nw, m, k, EPS)
            gpu.gemv(qkv.ptr + n * 2, normed, d_w, m, n, k, k_warps=k_warps)
            _sync()
            raw = qkv.get()[1:-1].copy()
            gpu.rope_write_kv(qkv.ptr + n * 2, *caches, d_pos, d_slots, inv_freq, m, hq, hkv, d)
        _sync()
        out[path] = [qkv.get(), *(c.get() for c in caches)]
    (q_f, k_f, v_f), (q_c, k_c, v_c) = out["fused"], out["chain"]
    poison = np.uint16(0x7FC0)
    assert np.all(_bits(q_f[[0, -1]]) == poison), "wrote outside qkv[0:m]"
    np.testing.assert_array_equal(_bits(q_f), _bits(q_c), err_msg="qkv: fused != rms_norm, gemv, rope_write_kv")
    np.testing.assert_array_equal(_bits(k_f), _bits(k_c), err_msg="k cache: fused != chain")
    np.testing.assert_array_equal(_bits(v_f), _bits(v_c), err_msg="v cache: fused != chain")
    written = np.zeros(4 * 16, bool)
    written[slots[slots >= 0]] = True
    flat = _bits(k_f).reshape(4 * 16, -1)
    assert np.all(flat[~written] == poison) and not np.any(flat[written] == poison)
    operand = ref.rms_norm_operand(stored, norm_w, EPS)
    _check_twin(raw, operand, w32, ref.linear(operand, w32))      # the chain's projection (k and v as stored)


@pytest.mark.parametrize("k_warps", [1, 3, 8, 32])
@pytest.mark.parametrize("m,k,hq,hkv,d", [(1, 2048, 32, 8, 64), (8, 576, 9, 3, 64), (3, 264, 2, 1, 64)])
def test_rope_kv_split_k(gpu, rng, m, k, hq, hkv, d, k_warps):
    test_rope_kv(gpu, rng, k, hq, hkv, d, m, "gemv", True, k_warps=k_warps)
    test_rope_kv(gpu, rng, k, hq, hkv, d, m, "gemv", False, k_warps=k_warps)


def test_fused_launchers_reject(gpu):
    kw = dict(num_q_heads=2, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="head_dim"):
        gpu.gemv_rope_kv(0, 0, 0, 1, 250, 64, 0, 0, 0, 0, 0, **kw)                  # n != (2 + 2) * 64
    with pytest.raises(ValueError, match="unsupported shape"):
        gpu.gemv_rope_kv(0, 0, 0, 9, 256, 64, 0, 0, 0, 0, 0, norm=(0, 0, EPS), **kw)  # m = 9
    with pytest.raises(ValueError, match="16-byte aligned"):
        gpu.gemv_silu_mul(0, 0, 0, 1, 32, 16, norm=(8, 0, EPS))                       # the norm weight
    with pytest.raises(ValueError, match="multiple of 16"):
        gpu.gemv_silu_mul(0, 0, 0, 1, 40, 16)
    with pytest.raises(ValueError, match="bf16 out"):
        gpu.gemv(0, 0, 0, 1, 16, 16, out_dtype="float32", ss_out=16)


def test_fuses_decode(gpu):
    """The fused layer runs when fusing is on and every projection is on the GEMV (m <= 8); the
    norm goes inside a GEMV of few CTAs only (unless TINYVLLM_FUSE_NORM says all / none)."""
    was = gpu.fuse, gpu.fuse_norm
    try:
        gpu.fuse_norm = "auto"
        assert gpu.fuses_norm(3072, 2048) and gpu.fuses_norm(3072, 576)   # 1B qkv, SmolLM2 gate_up
        assert not gpu.fuses_norm(16384, 2048)                          # 1B gate_up: 1024 CTAs
        gpu.fuse_norm = "all"
        assert gpu.fuses_norm(16384, 2048)
        gpu.fuse_norm = "none"
        assert not gpu.fuses_norm(960, 576)
        gpu.fuse = True
        assert gpu.fuses_decode(8, 576, 960, 1536, 64) == gpu.use_gemv
        assert not gpu.fuses_decode(9, 576, 960, 1536, 64)        # cuBLAS's
        assert not gpu.fuses_decode(1, 576, 960, 1536, 8)         # head_dim % 16
        gpu.fuse = False
        assert not gpu.fuses_decode(1, 576, 960, 1536, 64)
    finally:
        gpu.fuse, gpu.fuse_norm = was
