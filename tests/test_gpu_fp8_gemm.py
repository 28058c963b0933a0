"""FP8's W8A8 path on the GPU (an FP8 projection of more than 8 rows) against its numpy twins
(quant/fp8.py), on fresh random inputs with poisoned outputs:
  * cuda/fp8_quant.cu's quantize_rows_e4m3: codes and scales EXACTLY the twin's quantize_rows_e4m3
    (bf16 -> fp32 exact, max exact, IEEE division, round-to-nearest-even e4m3 on both sides); the
    row after the last stays poisoned.
  * gpu/cublaslt.py's FP8 GEMM (e4m3 x e4m3, per-row scales on both, bf16 Y, beta 0 or 1) on the
    twin's codes, against the same quantized product in float64. Tolerance, per element:
        ulp_bf16(want) + k * 2^-24 * sum_c |qx qw| * sx * sw + 4 * 2^-24 * (|P| + |C|)
    Both sides sum the same exact e4m3 products (8 significant bits, exact in fp32); the GPU sums in
    fp32 in its own order (off by at most gamma_k = k * 2^-24 of the sum of |products|, once
    fast accumulation is off), multiplies by the two scales and adds C in fp32 (a few 2^-24 of
    |P| + |C|), then rounds to bf16 once (half an ulp; one ulp allowed). Y sits between two
    poisoned guard rows that must keep their bits.
  * quant_linear() at m > 8 on an FP8 QuantMatrix (the kernel, then the GEMM) against
    fp8.w8a8_linear, and a CUDA graph capturing it (a decode batch of more than 8 sequences is
    captured) replaying to the eager bits.
Shapes: m = 9 (the first W8A8 row count), odd m, m = 300; k = 2048 and 8192; n = 2048 and 3072.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyvllm.quant import fp8
from tinyvllm.quant.block_format import BF16

pytestmark = pytest.mark.gpu

GEMM_SHAPES = [(9, 2048, 2048), (37, 3072, 2048), (300, 2048, 8192), (301, 3072, 8192), (9, 3072, 8192)]
U = 2.0 ** -24


@pytest.fixture(scope="module")
def lt(gpu_ops):
    """cuBLASLt on the default stream with the arena's workspace size."""
    import pycuda.driver as drv

    from tinyvllm.gpu.arena import CUBLAS_WORKSPACE_BYTES
    from tinyvllm.gpu.cublaslt import CublasLt
    workspace = drv.mem_alloc(CUBLAS_WORKSPACE_BYTES)
    handle = CublasLt(0, int(workspace), CUBLAS_WORKSPACE_BYTES)
    try:
        yield handle
        drv.Context.synchronize()
    finally:
        handle.close()
        workspace.free()


def _x(rng, m: int, k: int) -> np.ndarray:
    """bf16 X whose rows differ in magnitude by up to 2^40, a few large entries per row (most codes
    far below 448), one row of zeros (some -0) and one whose entries but the first lie 2^-12 below
    it (e4m3's subnormal codes)."""
    x = rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-20, 20, (m, 1))
    x[:, rng.integers(0, k, 4)] *= 64
    x[m // 2] = -0.0
    x[m // 2, ::3] = 0.0
    if m > 2:
        x[-1] = rng.standard_normal(k) * 2.0 ** -12
        x[-1, 0] = -4.0
    return x.astype(BF16)


def _weight(rng, n: int, k: int):
    from gpu_helpers import DeviceArray

    from tinyvllm.gpu.quant_weights import QuantMatrix, pack_planes
    w = fp8.quantize_per_channel(rng.standard_normal((n, k), dtype=np.float32) / np.float32(math.sqrt(k)))
    _, quants, scales = pack_planes(w)
    d_q, d_s = DeviceArray(quants), DeviceArray(scales)
    return w, QuantMatrix("FP8", d_q.ptr, d_s.ptr, n, k, quants.nbytes + scales.nbytes), (d_q, d_s)


def _codes_buffers(m: int, k: int):
    from gpu_helpers import DeviceArray
    return DeviceArray(np.full((m + 1, k), 0xFF, np.uint8)), DeviceArray.poisoned((m + 1,), np.float32)


@pytest.mark.parametrize("m,k", [(1, 16), (9, 2048), (300, 8192), (37, 3072)])
def test_quantize_rows_e4m3(gpu_ops, rng, m, k):
    import pycuda.driver as drv
    from gpu_helpers import DeviceArray
    x = _x(rng, m, k)
    codes, scales = _codes_buffers(m, k)
    gpu_ops.quantize_rows_e4m3(codes, scales, DeviceArray(x), m, k)
    drv.Context.synchronize()
    want_codes, want_scales = fp8.quantize_rows_e4m3(x)
    got_codes, got_scales = codes.get(), scales.get()
    np.testing.assert_array_equal(got_codes[:m], want_codes)
    np.testing.assert_array_equal(got_scales[:m].view(np.uint32), want_scales.view(np.uint32))
    assert np.all(got_codes[m] == 0xFF) and np.isnan(got_scales[m]), "wrote past row m"


def _bound(qx, sx, w, y0, k):
    """(want, per-element bound) in float64: the module docstring's tolerance."""
    qx64, qw64 = qx.view(fp8.E4M3).astype(np.float64), w.codes.astype(np.float64)
    scales = sx.astype(np.float64)[:, None] * w.row_scales().astype(np.float64)[None, :]
    product = (qx64 @ qw64.T) * scales
    c = np.zeros_like(product) if y0 is None else y0.astype(np.float64)
    want = product + c
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -126))) - 7)
    order = k * U * (np.abs(qx64) @ np.abs(qw64).T) * scales
    return want, ulp + order + 4 * U * (np.abs(product) + np.abs(c))


def _guarded_y(rng, m, n, accumulate):
    from gpu_helpers import DeviceArray
    buf = np.full((m + 2, n), 0x7FC0, np.uint16).view(BF16)
    y0 = rng.standard_normal((m, n)).astype(BF16) if accumulate else None
    if accumulate:
        buf[1:m + 1] = y0
    return buf, DeviceArray(buf), y0


def _check(d_y, buf, m, want, bound):
    import pycuda.driver as drv
    drv.Context.synchronize()
    got = d_y.get()
    np.testing.assert_array_equal(got[[0, m + 1]].view(np.uint16), buf[[0, m + 1]].view(np.uint16),
                                  err_msg="wrote outside Y[0:m]")
    err = np.abs(got[1:m + 1].astype(np.float64) - want)
    assert np.all(np.isfinite(err)) and np.all(err <= bound), f"worst excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_fp8_gemm(lt, rng, m, n, k, accumulate):
    from gpu_helpers import DeviceArray
    w, matrix, _keep = _weight(rng, n, k)
    qx, sx = fp8.quantize_rows_e4m3(_x(rng, m, k))
    d_qx, d_sx = DeviceArray(qx), DeviceArray(sx)
    buf, d_y, y0 = _guarded_y(rng, m, n, accumulate)
    lt.fp8_matmul(d_y.ptr + 2 * n, d_qx, matrix.data, d_sx, matrix.scales, m, n, k, accumulate=accumulate)
    want, bound = _bound(qx, sx, w, y0, k)
    _check(d_y, buf, m, want, bound)


@pytest.mark.parametrize("m,n,k", [(9, 2048, 2048), (300, 3072, 8192)])
def test_quant_linear_runs_w8a8_above_8_rows(gpu_ops, lt, rng, m, n, k):
    """quant_linear() at m > 8: the kernel's codes in the buffers, then the GEMM, against the twin."""
    from gpu_helpers import DeviceArray
    w, matrix, _keep = _weight(rng, n, k)
    x = _x(rng, m, k)
    codes, scales = _codes_buffers(m, k)
    gpu_ops.use_w8a8(lt, codes, scales, m, k)
    try:
        buf, d_y, y0 = _guarded_y(rng, m, n, True)
        gpu_ops.linear(d_y.ptr + 2 * n, DeviceArray(x), matrix, m, n, k, accumulate=True)
        qx, sx = fp8.quantize_rows_e4m3(x)
        want, bound = _bound(qx, sx, w, y0, k)
        _check(d_y, buf, m, want, bound)
        np.testing.assert_array_equal(codes.get()[:m], qx)
        twin = fp8.w8a8_linear(x, w) + y0.astype(np.float32)
        assert np.all(np.abs(twin - want) <= bound)
    finally:
        gpu_ops.w8a8_buffers = None


def test_a_cuda_graph_captures_w8a8(gpu_ops, rng):
    """The kernel and the cuBLASLt GEMM captured on a stream (its plan made by the eager run before,
    as the decode graphs are) replay to the eager run's bits."""
    import pycuda.driver as drv
    from gpu_helpers import DeviceArray

    from tinyvllm.gpu.arena import CUBLAS_WORKSPACE_BYTES
    from tinyvllm.gpu.cublaslt import CublasLt
    from tinyvllm.gpu.graphs import CudaGraph
    from tinyvllm.gpu.ops import GpuOps
    m, n, k = 16, 2048, 2048
    stream = drv.Stream()
    workspace = drv.mem_alloc(CUBLAS_WORKSPACE_BYTES)
    handle = CublasLt(stream.handle, int(workspace), CUBLAS_WORKSPACE_BYTES)
    ops = GpuOps(gpu_ops.library, stream, None, gpu_ops.num_sms)
    w, matrix, _keep = _weight(rng, n, k)
    codes, scales = _codes_buffers(m, k)
    ops.use_w8a8(handle, codes, scales, m, k)
    x = DeviceArray(_x(rng, m, k))
    eager, replayed = DeviceArray.poisoned((m, n), BF16), DeviceArray.poisoned((m, n), BF16)
    graph = None
    try:
        ops.linear(eager, x, matrix, m, n, k)
        with CudaGraph.capture(stream) as graph:
            ops.linear(replayed, x, matrix, m, n, k)
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(replayed.get().view(np.uint16), eager.get().view(np.uint16))
    finally:
        if graph is not None:
            graph.close()
        stream.synchronize()
        handle.close()
        workspace.free()
