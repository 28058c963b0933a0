"""The fused decode GEMVs (cuda/gemv.cu: gemv_rms_norm_bf16, gemv_silu_mul_bf16) against the
unfused kernel pairs they replace and against their numpy twins.

1. Bitwise: the fused kernel's Y equals, bit for bit, rms_norm() then gemv() (resp. silu_mul()
   then gemv()) run on the GPU with the same k_warps (the split of K fixes the summation order).
   common.cuh gives both sides the same arithmetic, so any difference is a bug, not rounding.
2. Against the twin (reference/kernels.py rms_norm_linear / silu_mul_linear), elementwise:
       |Y - Y_twin| <= (2^-7 + 2 k 2^-24) (|a| @ |W|^T)  [+ 2^-8 (|Y_twin| + that) for bf16 out]
   a = the twin's bf16 operand: the GPU's operand may be one bf16 ulp (2^-7 relative) away from
   it where the fp32 formulas round differently (inverse RMS from rsqrtf, __expf, __fdividef:
   a few fp32 ulps), both sides accumulate k products in fp32 (each within k 2^-24 of the sum of
   absolute products), and a bf16 Y is rounded once more (2^-8 relative).
3. Nothing written outside Y[0:m, 0:n]: Y sits between poisoned guard rows that must keep their
   bits. X, W and the norm weight carry NaN past their last valid row / element, so a kernel that
   read them would turn its outputs NaN.
Inputs are drawn fresh each run (seeds printed by the rng fixture / the weight cache).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyvllm.reference import kernels as ref

pytestmark = pytest.mark.gpu

# 1B qkv / gate_up / down, SmolLM2-135M qkv / gate_up / down, tiny qkv, tails (k not a multiple of
# rms_norm's 2048-value stride, k past one stride, k < 256: virtual warps with nothing to sum)
NORM_SHAPES = [(3072, 2048), (16384, 2048), (960, 576), (3072, 576), (512, 256), (1000, 264), (130, 2056),
               (37, 8)]
SILU_SHAPES = [(2048, 8192), (576, 1536), (256, 768), (130, 264), (37, 8)]
EPS = 1e-5


@pytest.fixture(scope="module")
def gpu(gpu_ops):
    return gpu_ops


def _sync():
    import pycuda.driver as drv
    drv.Context.synchronize()


def _with_nan_rows(a: np.ndarray, rows: int = 1) -> np.ndarray:
    from gpu_helpers import BF16
    return np.concatenate([a, np.full((rows, *a.shape[1:]), np.nan, np.float32).astype(BF16)])


class _Y:
    """A poisoned [m, n] output between two poisoned guard rows (or holding y0 for accumulate)."""

    def __init__(self, m: int, n: int, out_dtype: str, y0=None):
        from gpu_helpers import BF16, POISON, DeviceArray
        self.m, self.n = m, n
        self.dtype = np.dtype(BF16) if out_dtype == "bfloat16" else np.dtype(np.float32)
        pattern = POISON[self.dtype]
        self.buf = np.full((m + 2, n), pattern, pattern.dtype).view(self.dtype)
        if y0 is not None:
            self.buf[1:m + 1] = np.asarray(y0, np.float32).astype(self.dtype)
        self.dev = DeviceArray(self.buf)
        self.ptr = self.dev.ptr + n * self.dtype.itemsize

    def read(self):
        """-> (Y rows as stored, raw bits of the guard rows read back, as written)."""
        got = self.dev.get()
        bits = got.view(np.uint16 if self.dtype.itemsize == 2 else np.uint32)
        want = self.buf.view(bits.dtype)
        guards = np.stack([bits[0], bits[-1]]), np.stack([want[0], want[-1]])
        return got[1:self.m + 1], guards


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _check_twin(got, want_operand, w32, want, out_dtype):
    k = want_operand.shape[-1]
    bound = (2.0 ** -7 + 2 * k * 2.0 ** -24) * (np.abs(want_operand) @ np.abs(w32).T)
    if out_dtype == "bfloat16":
        bound = bound + 2.0 ** -8 * (np.abs(want) + bound)
    got = got.astype(np.float32)
    assert np.all(np.isfinite(got)), "NaN/inf in Y (unwritten poison, or a NaN row was read)"
    worst = float(np.max(np.abs(got - want) / np.maximum(bound, 1e-30)))
    print(f"[fused-bound] worst |Y - twin| / bound = {worst:.3f}")
    assert worst <= 1.0


def _weights(rng, n, k):
    from gpu_helpers import DeviceArray, to_bf16
    w = to_bf16(rng.standard_normal((n, k)) / math.sqrt(k))
    return w.astype(np.float32), DeviceArray(_with_nan_rows(w, 16))


def _norm_case(gpu, rng, m, n, k, out_dtype, accumulate, k_warps=None):
    from gpu_helpers import DeviceArray, to_bf16
    x = to_bf16(rng.standard_normal((m, k)) * rng.uniform(0.1, 30))   # residual stream scale varies
    norm_w = to_bf16(1 + 0.2 * rng.standard_normal(k))
    w32, d_w = _weights(rng, n, k)
    d_x = DeviceArray(_with_nan_rows(x))
    d_nw = DeviceArray(np.concatenate([norm_w, np.full(8, np.nan, np.float32).astype(norm_w.dtype)]))
    y0 = rng.standard_normal((m, n)) if accumulate else None
    fused, unfused = _Y(m, n, out_dtype, y0), _Y(m, n, out_dtype, y0)
    normed = DeviceArray.poisoned((m, k), x.dtype)
    kw = dict(accumulate=accumulate, out_dtype=out_dtype, k_warps=k_warps)
    gpu.gemv_rms_norm(fused.ptr, d_x, d_nw, d_w, m, n, k, EPS, **kw)
    gpu.rms_norm(normed, d_x, d_nw, m, k, EPS)
    gpu.gemv(unfused.ptr, normed, d_w, m, n, k, **kw)
    got = _fused_output_equal_to_pair(fused, unfused, "rms_norm + gemv")
    operand = ref.rms_norm_operand(x, norm_w, EPS)
    want = ref.rms_norm_linear(x, norm_w, w32, EPS) + (fused.buf[1:m + 1].astype(np.float32) if accumulate else 0)
    _check_twin(got, operand, w32, want, out_dtype)


def _fused_output_equal_to_pair(fused, unfused, pair: str):
    """After both launches: the fused kernel wrote only Y[0:m, 0:n], bit for bit what the
    kernel pair wrote. -> the fused output."""
    _sync()
    got, guards = fused.read()
    base, _ = unfused.read()
    np.testing.assert_array_equal(*guards, err_msg="wrote outside Y[0:m, 0:n]")
    np.testing.assert_array_equal(_bits(got), _bits(base), err_msg=f"fused != {pair}")
    return got


def _silu_case(gpu, rng, m, n, k, out_dtype, accumulate, k_warps=None):
    from gpu_helpers import DeviceArray, to_bf16
    gate_up = to_bf16(rng.standard_normal((m, 2 * k)) * 3)
    gate_up[0, :min(4, k)] = np.array([-100.0, -89.0, 0.0, 100.0][:min(4, k)], np.float32)   # exp overflow
    w32, d_w = _weights(rng, n, k)
    d_gu = DeviceArray(_with_nan_rows(gate_up))
    y0 = rng.standard_normal((m, n)) if accumulate else None
    fused, unfused = _Y(m, n, out_dtype, y0), _Y(m, n, out_dtype, y0)
    act = DeviceArray.poisoned((m, k), gate_up.dtype)
    kw = dict(accumulate=accumulate, out_dtype=out_dtype, k_warps=k_warps)
    gpu.gemv_silu_mul(fused.ptr, d_gu, d_w, m, n, k, **kw)
    gpu.silu_mul(act, d_gu, m, k)
    gpu.gemv(unfused.ptr, act, d_w, m, n, k, **kw)
    got = _fused_output_equal_to_pair(fused, unfused, "silu_mul + gemv")
    operand = ref.silu_mul_operand(gate_up)
    want = ref.silu_mul_linear(gate_up, w32) + (fused.buf[1:m + 1].astype(np.float32) if accumulate else 0)
    _check_twin(got, operand, w32, want, out_dtype)


def _modes():
    # the model's use first (bf16 out; set for the norm GEMVs, accumulate for down), then the rest
    return [("bfloat16", False), ("bfloat16", True), ("float32", False)]


@pytest.mark.parametrize("out_dtype,accumulate", _modes(), ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", NORM_SHAPES, ids=lambda v: str(v))
def test_gemv_rms_norm(gpu, rng, n, k, m, out_dtype, accumulate):
    _norm_case(gpu, rng, m, n, k, out_dtype, accumulate)


@pytest.mark.parametrize("out_dtype,accumulate", _modes(), ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", SILU_SHAPES, ids=lambda v: str(v))
def test_gemv_silu_mul(gpu, rng, n, k, m, out_dtype, accumulate):
    _silu_case(gpu, rng, m, n, k, out_dtype, accumulate)


@pytest.mark.parametrize("k_warps", [1, 3, 8, 32])
@pytest.mark.parametrize("m,n,k", [(1, 3072, 2048), (8, 960, 576), (5, 1000, 264), (3, 130, 2056)])
def test_gemv_rms_norm_split_k(gpu, rng, m, n, k, k_warps):
    """Every split of K, including more warps than steps (warps that only help with the norm)."""
    _norm_case(gpu, rng, m, n, k, "bfloat16", False, k_warps=k_warps)


@pytest.mark.parametrize("k_warps", [1, 3, 8, 32])
@pytest.mark.parametrize("m,n,k", [(1, 2048, 8192), (8, 576, 1536), (5, 130, 264)])
def test_gemv_silu_mul_split_k(gpu, rng, m, n, k, k_warps):
    _silu_case(gpu, rng, m, n, k, "bfloat16", True, k_warps=k_warps)


def test_fused_launchers_reject(gpu):
    with pytest.raises(ValueError, match="unsupported shape"):
        gpu.gemv_rms_norm(0, 0, 0, 0, 9, 16, 16, EPS)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gpu.gemv_rms_norm(0, 0, 8, 0, 1, 16, 16, EPS)       # the norm weight
    with pytest.raises(ValueError, match="k % 8"):
        gpu.gemv_silu_mul(0, 0, 0, 1, 16, 12)
    with pytest.raises(ValueError, match="out_dtype"):
        gpu.gemv_silu_mul(0, 0, 0, 1, 16, 16, out_dtype="float16")


@pytest.mark.parametrize("m", [1, 8, 9])
def test_norm_linear_and_silu_linear_dispatch(gpu, rng, m):
    """The model's entry points: fused at m <= 8 (and fuse on), the separate kernels with their
    scratch buffers otherwise (m = 9 is cuBLAS's); both give the fused kernel's bits at m <= 8."""
    from gpu_helpers import DeviceArray, to_bf16
    n, k, inter = 96, 64, 80
    x = DeviceArray(to_bf16(rng.standard_normal((m, k))))
    norm_w = DeviceArray(to_bf16(1 + 0.2 * rng.standard_normal(k)))
    w_qkv = DeviceArray(to_bf16(rng.standard_normal((2 * inter, k)) / math.sqrt(k)))
    w_down = DeviceArray(to_bf16(rng.standard_normal((n, inter)) / math.sqrt(inter)))
    results, was = {}, gpu.fuse
    for fuse in (True, False):
        gpu.fuse = fuse
        try:
            gate_up = DeviceArray.poisoned((m, 2 * inter), w_qkv.host.dtype)
            normed = DeviceArray.poisoned((m, k), w_qkv.host.dtype)
            act = DeviceArray.poisoned((m, inter), w_qkv.host.dtype)
            y = DeviceArray(to_bf16(rng.standard_normal((m, n))) if fuse else results[True][2])
            y0 = y.host.copy()
            gpu.norm_linear(gate_up, x, norm_w, w_qkv, m, 2 * inter, k, EPS, normed=normed)
            gpu.silu_linear(y, gate_up, w_down, m, n, inter, act=act, accumulate=True)
            _sync()
            results[fuse] = (gate_up.get(), y.get(), y0, _bits(normed.get()))
        finally:
            gpu.fuse = was
    poison = np.uint16(0x7FC0)
    fused_path = m <= 8 and gpu.use_gemv
    # the fused path never writes the scratch buffers; the unfused path fills them
    assert np.all(results[True][3] == poison) == fused_path
    assert not np.any(results[False][3] == poison)
    for fuse in (True, False):
        assert np.all(np.isfinite(results[fuse][1].astype(np.float32)))
    if fused_path:   # the GEMV on both paths: bit-identical
        np.testing.assert_array_equal(_bits(results[True][0]), _bits(results[False][0]))
        np.testing.assert_array_equal(_bits(results[True][1]), _bits(results[False][1]))
