"""Gemv.linear (cuda/gemv.cu) against numpy: Y[m, n] (+)= X[m, k] @ W[n, k]^T for m <= 8.

Reference: fp32 X @ W^T on the bf16-rounded inputs (plus the fp32 Y0 for accumulate).
Tolerances, relative (Frobenius): bf16 out <= 1e-2, fp32 out <= 1e-4. Every case also checks
that the kernel wrote nothing outside Y[0:m, 0:n]: Y sits between a poisoned row before and a
poisoned row after (row stride n), and those must keep their exact poison bits. X and W carry
NaN rows past m and n, which would surface if the kernel mixed them into a valid output.
Weights are drawn fresh each run (seed printed) and shared by the cases of one (n, k) shape.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

BF16_TOL, FP32_TOL = 1e-2, 1e-4
LLAMA_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]   # qkv, o, gate_up, down
ODD_SHAPES = [(1000, 264), (37, 8), (130, 72)]                            # tails in n and k
LM_HEAD = (128256, 2048)


def _cases():
    """Ordered by shape, so the one-entry weight cache below regenerates W once per shape."""
    cases = []
    for n, k in LLAMA_SHAPES + ODD_SHAPES:
        for m in (1, 2, 3, 5, 8):
            for accumulate in (False, True):
                for out in ("bfloat16", "float32"):
                    cases.append(pytest.param(m, n, k, accumulate, out,
                                              id=f"m{m}-n{n}-k{k}-{'acc' if accumulate else 'set'}-{out}"))
    for m in (1, 8):
        for accumulate in (False, True):
            cases.append(pytest.param(m, *LM_HEAD, accumulate, "float32",
                                      id=f"lm_head-m{m}-{'acc' if accumulate else 'set'}-float32"))
    return cases


@pytest.fixture(scope="module")
def gpu(gpu_ops):
    yield gpu_ops
    _WEIGHTS.clear()


_WEIGHTS: dict = {}   # (n, k) -> (fp32 copy of the bf16 W, device W with 16 NaN rows after it)


def _weights(n: int, k: int):
    from gpu_helpers import BF16, DeviceArray
    if (n, k) not in _WEIGHTS:
        _WEIGHTS.clear()   # one shape at a time: lm_head's W is 525 MB
        seed = np.random.SeedSequence().entropy % 2**32
        print(f"weight seed {seed}")
        rng = np.random.default_rng(seed)
        w = (rng.standard_normal((n, k), dtype=np.float32) / np.float32(math.sqrt(k))).astype(BF16)
        padded = np.concatenate([w, np.full((16, k), np.nan, np.float32).astype(BF16)])
        _WEIGHTS[(n, k)] = (w.astype(np.float32), DeviceArray(padded))
    return _WEIGHTS[(n, k)]


def _sync():
    import pycuda.driver as drv
    drv.Context.synchronize()


def _run(gemv, rng, m, n, k, accumulate, out_dtype, k_warps=None):
    """One call on fresh X (and Y0); returns (got Y, wanted Y, guard rows before/after as read back
    and as written)."""
    from gpu_helpers import BF16, POISON, DeviceArray, to_bf16
    w32, d_w = _weights(n, k)
    x = to_bf16(rng.standard_normal((m, k)))
    d_x = DeviceArray(np.concatenate([x, np.full((1, k), np.nan, np.float32).astype(BF16)]))
    dtype = np.dtype(BF16) if out_dtype == "bfloat16" else np.dtype(np.float32)
    pattern = POISON[dtype]
    buf = np.full((m + 2, n), pattern, pattern.dtype).view(dtype)        # guard row, Y, guard row
    y0 = None
    if accumulate:
        y0 = rng.standard_normal((m, n)).astype(np.float32).astype(dtype)
        buf[1:m + 1] = y0
    d_y = DeviceArray(buf)
    gemv.gemv(d_y.ptr + n * dtype.itemsize, d_x, d_w, m, n, k, accumulate=accumulate,
                out_dtype=out_dtype, k_warps=k_warps)
    _sync()
    got = d_y.get()
    want = x.astype(np.float32) @ w32.T
    if accumulate:
        want = want + y0.astype(np.float32)
    guards_got = np.stack([got[0], got[m + 1]]).view(pattern.dtype)
    guards_want = np.stack([buf[0], buf[m + 1]]).view(pattern.dtype)
    return got[1:m + 1].astype(np.float32), want, guards_got, guards_want


@pytest.mark.parametrize("m,n,k,accumulate,out_dtype", _cases())
def test_gemv_linear(gpu, rng, m, n, k, accumulate, out_dtype):
    from gpu_helpers import rel_err
    got, want, guards_got, guards_want = _run(gpu, rng, m, n, k, accumulate, out_dtype)
    np.testing.assert_array_equal(guards_got, guards_want, err_msg="wrote outside Y[0:m, 0:n]")
    tol = BF16_TOL if out_dtype == "bfloat16" else FP32_TOL
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("k_warps", [1, 2, 3, 5, 8, 16, 31, 32])
@pytest.mark.parametrize("m,n,k", [(1, 2048, 2048), (8, 2048, 2048), (3, 1000, 264), (5, 130, 72),
                                   (7, 2048, 8192), (1, 37, 8)])
def test_gemv_split_k(gpu, rng, m, n, k, k_warps):
    """Every split of K across a CTA's warps, including uneven ones and more warps than 32-wide
    steps (warps with nothing to do), gives the same result. A warp's steps then number 0, fewer
    than the ring's RING_STEPS slots, or many times more (k 8192 on one warp: 256 refills)."""
    from gpu_helpers import rel_err
    got, want, guards_got, guards_want = _run(gpu, rng, m, n, k, True, "float32", k_warps=k_warps)
    np.testing.assert_array_equal(guards_got, guards_want, err_msg="wrote outside Y[0:m, 0:n]")
    assert rel_err(got, want) < FP32_TOL


def test_gemv_launch_shapes(gpu):
    """The split-K choice stays inside the kernel's limits for every model shape (shared memory
    within the 227 KB a CTA may have)."""
    from tinyvllm.gpu.ops import GEMV
    for n, k in LLAMA_SHAPES + ODD_SHAPES + [LM_HEAD]:
        grid, block, shared = gpu.gemv_launch_shape(n, k)
        assert grid[0] * 16 >= n and block[0] % 32 == 0 and 32 <= block[0] <= 1024
        assert shared == block[0] // 32 * (512 + GEMV["RING_BYTES_PER_WARP"]) and shared <= 227 << 10
        print(f"n={n} k={k}: grid {grid[0]}, {block[0] // 32} warps per CTA")


def test_gemv_rejects(gpu):
    supports = gpu.gemv_supports
    assert supports(1, 1, 8) and supports(8, 128256, 2048)
    assert not supports(9, 16, 16) and not supports(0, 16, 16)
    assert not supports(1, 16, 12) and not supports(1, 0, 16)
    with pytest.raises(ValueError, match="unsupported shape"):
        gpu.gemv(0, 0, 0, 9, 16, 16)
    with pytest.raises(ValueError, match="k % 8"):
        gpu.gemv(0, 0, 0, 1, 16, 12)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gpu.gemv(0, 8, 0, 1, 16, 16)
    with pytest.raises(ValueError, match="out_dtype"):
        gpu.gemv(0, 0, 0, 1, 16, 16, out_dtype="float16")
