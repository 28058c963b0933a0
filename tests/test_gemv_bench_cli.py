"""benchmarks/gemv_bench.py on the CPU: its arguments, its random quantized weights, its k_warps
candidates, and both of its benches end to end against a fake device (numpy memory, launches that
compute the kernel's result with the kind's planes read back from that memory, no timing), so the
upload layout, the ops-layer calls and the table are checked without a GPU."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tinyvllm.gpu.ops import GpuOps
from tinyvllm.gpu.ops.quant_gemv import QGEMV, max_k_warps, quant_gemv_shape
from tinyvllm.gpu.quant_weights import QuantMatrix, pack_planes, planes_dequantize_bf16
from tinyvllm.quant.block_format import BF16, bf16_as_f32
from tinyvllm.quant.fp8 import Fp8Weight
from tinyvllm.quant.weight_kinds import GPU_KINDS

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [("qkv", 96, 576, False, "bfloat16"), ("o", 64, 64, True, "bfloat16"),
          ("gate_up", 32, 128, False, "bfloat16"), ("down", 48, 256, True, "bfloat16"),
          ("lm_head", 40, 96, False, "float32")]
NAMES = {s[0] for s in SHAPES}


def _bench():
    spec = importlib.util.spec_from_file_location("gemv_bench", ROOT / "benchmarks" / "gemv_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gemv_bench", module)
    spec.loader.exec_module(module)
    module.BF16 = ml_dtypes.bfloat16               # main() sets it
    return module


bench = _bench()


def test_arguments():
    assert bench.KINDS == GPU_KINDS
    assert (bench.parse_args([]).kind, bench.parse_args([]).shapes) == ("bf16", "1b")
    assert bench.parse_args(["--kind", "Q4_K", "--shapes", "135m"]).kind == "Q4_K"
    with pytest.raises(SystemExit):
        bench.parse_args(["--kind", "Q5_K"])


@pytest.mark.parametrize("kind", bench.KINDS)
def test_random_weight_packs_and_has_realistic_scales(kind):
    k = bench.kind_k(kind, 576)
    assert k == (768 if kind in ("Q4_K", "Q6_K") else 576)
    w = bench.random_weight(kind, 48, k, np.random.default_rng(1))
    assert w.shape == (48, k) and pack_planes(w)[0] == kind
    if isinstance(w, Fp8Weight):
        return
    scales = np.abs(w.format.fp16_scales(w.blocks, w.shape).astype(np.float32))
    assert np.isfinite(scales).all() and scales.min() >= 0.99e-3 and scales.max() <= 1.01e-2


@pytest.mark.parametrize("kind", bench.KINDS)
@pytest.mark.parametrize("shapes", [bench.SHAPES, bench.SHAPES_135M])
def test_k_warps_candidates_fit_and_hold_the_rule(kind, shapes):
    ops = GpuOps(None, num_sms=132)
    for _, n, k, _, _ in shapes:
        k = bench.kind_k(kind, k)
        kws = bench.quant_k_warps_sweep(kind, n, k)
        assert kws and kws[0] == 1 and all(b == 2 * a for a, b in zip(kws, kws[1:]))
        assert kws[-1] <= max_k_warps(kind)
        assert all(quant_gemv_shape(kind, n, kw)[2] + 2 * k <= QGEMV["MAX_SHARED_BYTES"] for kw in kws)
        assert ops.quant_k_warps(QuantMatrix(kind, 0, 0, n, k, 0)) in kws


class _Alloc(int):
    def free(self):
        pass


class FakeDrv:
    """pycuda.driver's calls the bench makes, on one numpy byte array."""

    def __init__(self):
        self.mem, self.top = np.zeros(64 << 20, np.uint8), 1 << 12
        self.Context = self

    def synchronize(self):
        pass

    def mem_alloc(self, nbytes):
        at, self.top = self.top, self.top + -(-int(nbytes) // 256) * 256
        assert self.top <= self.mem.size
        return _Alloc(at)

    def to_device(self, a):
        at = self.mem_alloc(a.nbytes)
        self.memcpy_htod(at, a)
        return at

    def memcpy_htod(self, dst, a):
        a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self.mem[int(dst):int(dst) + a.size] = a

    def memcpy_dtod(self, dst, src, nbytes):
        self.mem[int(dst):int(dst) + nbytes] = self.mem[int(src):int(src) + nbytes]

    def memcpy_dtoh(self, a, src):
        a.reshape(-1).view(np.uint8)[:] = self.mem[int(src):int(src) + a.nbytes]

    def memset_d8(self, dst, value, nbytes):
        self.mem[int(dst):int(dst) + nbytes] = value

    def read(self, ptr, shape, dtype):
        dtype = np.dtype(dtype)
        return self.mem[int(ptr):int(ptr) + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    def product(self, y, x, w, m, n, k, out_dtype, accumulate, scale=None):
        """Y (+)= bf16 X @ W^T in fp32, stored as the kernels store it."""
        got = bf16_as_f32(self.read(x, (m, k), BF16)) @ bf16_as_f32(w).T
        got = got * scale if scale is not None else got
        out = np.float32 if out_dtype else BF16
        if accumulate:
            got = got + self.read(y, (m, n), out).astype(np.float32)
        self.memcpy_htod(y, got.astype(out))


class FakeOps(GpuOps):
    """GpuOps with launches that compute gemv_bf16 / gemv_quant_<kind>'s result on FakeDrv's memory."""

    def __init__(self, drv):
        super().__init__(None, num_sms=132)
        self.drv, self.launches = drv, []

    def _launch(self, kernel, grid, block, *args, shared_bytes=0):
        self.launches.append((kernel, block[0] // 32))
        if kernel == "gemv_bf16":
            y, x, w, m, n, k, out, acc = args
            self.drv.product(y, x, self.drv.read(w, (n, k), BF16), m, n, k, out, acc)
            return
        kind = next(kd for kd, names in self.KERNELS.items() if names["gemv_bf16"] == kernel)
        y, x, data, scales, m, n, k, out, acc = args
        planes = self.drv.mem[data:], self.drv.mem[scales:]
        quants = planes[0][:n * k // (2 if kind in ("Q4_0", "Q4_1", "Q4_K") else 1)]
        scale_bytes = {"FP8": 4 * n, "Q4_1": 4 * n * (k // 32), "Q4_K": 8 * n * (k // 32),
                       "Q6_K": 4 * n * (k // 16)}.get(kind, 2 * n * (k // 32 + k // 32 % 2))
        w = planes_dequantize_bf16(kind, quants, planes[1][:scale_bytes], n, k)
        row_scale = planes[1][:4 * n].view(np.float32) if kind == "FP8" else None
        self.drv.product(y, x, w, m, n, k, out, acc, row_scale)


class FakeBlas:
    def __init__(self, drv):
        self.drv = drv

    def matmul(self, y, x, w, m, n, k, *, accumulate=False, out_dtype="bfloat16"):
        self.drv.product(y, x, self.drv.read(w, (n, k), BF16), m, n, k, out_dtype == "float32", accumulate)


def _fake_bench(monkeypatch):
    drv = FakeDrv()
    monkeypatch.setattr(bench, "ROTATE_BYTES", 1 << 17)
    monkeypatch.setattr(bench, "MS", (1, 8))
    monkeypatch.setattr(bench, "time_calls", lambda drv, stream, enqueue, calls: [enqueue(i) for i in range(calls)]
                        and 1.0 + calls % 3)
    stream = type("Stream", (), {"synchronize": lambda self: None})()
    return drv, stream, FakeOps(drv)


@pytest.mark.parametrize("kind", bench.KINDS)
def test_quant_bench_end_to_end_on_a_fake_device(monkeypatch, capsys, kind):
    drv, stream, ops = _fake_bench(monkeypatch)
    bench.bench_quant(drv, stream, ops, kind, SHAPES, 2, 0.0)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in NAMES
            and "M=" not in line]
    assert len(rows) == 2 * len(SHAPES)
    for row in rows:                       # diff: the twin against the planes read back, computed alike
        assert float(row[-1 if "->" not in row[-1] else -3]) < 2.0 ** -7, row
    assert ("k 576->768" in out) == (kind in ("Q4_K", "Q6_K"))
    assert "*" in out and "decode step GEMMs at M=8" in out
    used = {kw for kernel, kw in ops.launches if kernel != "gemv_bf16"}
    assert used == {kw for _, n, k, _, _ in SHAPES for kw in bench.quant_k_warps_sweep(kind, n, bench.kind_k(kind, k))}


def test_bf16_bench_end_to_end_on_a_fake_device(monkeypatch, capsys):
    drv, stream, ops = _fake_bench(monkeypatch)
    bench.bench_bf16(drv, stream, FakeBlas(drv), ops, SHAPES, 2, 0.0)
    out = capsys.readouterr().out
    assert "Gemv vs cuBLAS" in out and out.count("decode step GEMMs") == 2
    rows = [line.split() for line in out.splitlines() if "x" in line and line.split()[0] in NAMES
            and "M=" not in line]
    assert len(rows) == 2 * len(SHAPES) and all(float(r[-1]) == 0.0 for r in rows)
