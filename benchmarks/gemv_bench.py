"""Gemv (cuda/gemv.cu) vs cuBLAS at the Llama-3.2-1B decode projections, M in {1, 2, 4, 8}.

    source .gpu/gpu-env.sh && python3 benchmarks/gemv_bench.py [--shapes 1b|135m]

(--shapes 135m: the SmolLM2-135M projections and its 49,152 x 576 LM head instead.)

GPU time per call: R calls are captured into one CUDA graph (driver API through ctypes; PyCUDA
has no graph binding), the graph is replayed 3 times to warm up and then 50 times between CUDA
events; a call's time is the median replay / R. The R calls rotate over enough copies of the
weight (>= 256 MB in all) that L2 (50-60 MB) never serves them. X is random bf16; o and down
accumulate into Y (their fused residual add), lm_head writes fp32. Before the table: our time
for every split-K choice (k_warps), so gemv_k_warps' rule can be checked against the best
measured choice.
The table comes last; its `diff` column is max |ours - cuBLAS| / max |cuBLAS| on one call.
Runs in well under a minute once the kernels are in PyCUDA's cache (the GPU tests fill it).
"""
from __future__ import annotations

import ctypes
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BF16 = None  # ml_dtypes.bfloat16, set in main() (imports stay lazy)

SHAPES = [  # name, N (out), K (in), accumulate, out dtype
    ("qkv", 3072, 2048, False, "bfloat16"),
    ("o", 2048, 2048, True, "bfloat16"),
    ("gate_up", 16384, 2048, False, "bfloat16"),
    ("down", 2048, 8192, True, "bfloat16"),
    ("lm_head", 128256, 2048, False, "float32"),
]
SHAPES_135M = [
    ("qkv", 960, 576, False, "bfloat16"),
    ("o", 576, 576, True, "bfloat16"),
    ("gate_up", 3072, 576, False, "bfloat16"),
    ("down", 576, 1536, True, "bfloat16"),
    ("lm_head", 49152, 576, False, "float32"),
]
LAYERS = 16
MS = (1, 2, 4, 8)
K_WARPS = (1, 2, 4, 8, 16, 32)
ROTATE_BYTES = 256 << 20
MIN_CALLS = 8
WARMUP, REPS = 3, 50
CU_STREAM_CAPTURE_MODE_RELAXED = 2


class Graph:
    """Capture everything `record()` enqueues on `stream` into a CUDA graph (driver API)."""

    _cuda = None

    def __init__(self, stream, record):
        if Graph._cuda is None:
            cuda = ctypes.CDLL("libcuda.so.1")
            vp = ctypes.c_void_p
            cuda.cuStreamBeginCapture_v2.argtypes = [vp, ctypes.c_int]
            cuda.cuStreamEndCapture.argtypes = [vp, ctypes.POINTER(vp)]
            cuda.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_ulonglong]
            cuda.cuGraphLaunch.argtypes = [vp, vp]
            cuda.cuGraphExecDestroy.argtypes = [vp]
            cuda.cuGraphDestroy.argtypes = [vp]
            cuda.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            Graph._cuda = cuda
        self.stream = ctypes.c_void_p(stream.handle)
        self.graph, self.exec = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self._cuda.cuStreamBeginCapture_v2(self.stream, CU_STREAM_CAPTURE_MODE_RELAXED),
                    "cuStreamBeginCapture")
        try:
            record()
        finally:
            status = self._cuda.cuStreamEndCapture(self.stream, ctypes.byref(self.graph))
        self._check(status, "cuStreamEndCapture")
        self._check(self._cuda.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), self.graph, 0),
                    "cuGraphInstantiate")

    def _check(self, status, what):
        if status != 0:
            msg = ctypes.c_char_p()
            self._cuda.cuGetErrorString(status, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: {msg.value.decode() if msg.value else status}")

    def launch(self):
        self._check(self._cuda.cuGraphLaunch(self.exec, self.stream), "cuGraphLaunch")

    def close(self):
        self._cuda.cuGraphExecDestroy(self.exec)
        self._cuda.cuGraphDestroy(self.graph)


def time_calls(drv, stream, enqueue, calls: int) -> float:
    """Median GPU microseconds per call of enqueue(i), i = 0 .. calls-1, replayed as one graph."""
    graph = Graph(stream, lambda: [enqueue(i) for i in range(calls)])
    try:
        for _ in range(WARMUP):
            graph.launch()
        events = [(drv.Event(), drv.Event()) for _ in range(REPS)]
        for start, end in events:
            start.record(stream)
            graph.launch()
            end.record(stream)
        events[-1][1].synchronize()
        return statistics.median(end.time_since(start) for start, end in events) * 1e3 / calls
    finally:
        graph.close()


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=("1b", "135m"), default="1b")
    small = ap.parse_args().shapes == "135m"
    shapes, layers = (SHAPES_135M, 30) if small else (SHAPES, LAYERS)
    import ml_dtypes
    import pycuda.driver as drv

    from tinyvllm.gpu.cublas import Cublas
    from tinyvllm.gpu.kernels import KernelLibrary
    from tinyvllm.gpu.ops import GpuOps

    global BF16
    BF16 = ml_dtypes.bfloat16
    t_start = time.perf_counter()
    drv.init()
    device = drv.Device(0)
    ctx = device.retain_primary_context()
    ctx.push()
    try:
        stream = drv.Stream()
        ws_bytes = 32 << 20
        workspace = drv.mem_alloc(ws_bytes)
        blas = Cublas(stream.handle, int(workspace), ws_bytes)
        gemv = GpuOps(KernelLibrary(), stream, blas)
        print(f"{device.name()}, {gemv.num_sms} SMs; setup {time.perf_counter() - t_start:.1f} s")

        rng = np.random.default_rng(0)
        rows = []
        for name, n, k, accumulate, out_dtype in shapes:
            nbytes = n * k * 2
            copies = max(1, math.ceil(ROTATE_BYTES / nbytes))
            calls = max(copies, MIN_CALLS)
            weights = drv.mem_alloc(copies * nbytes)
            block = min(nbytes, 16 << 20)
            # PyCUDA's to_device cannot take the bf16 dtype itself: hand it the raw 16-bit words
            seed = drv.to_device((rng.standard_normal(block // 2, dtype=np.float32)
                                  / np.float32(math.sqrt(k))).astype(BF16).view(np.uint16))
            for off in range(0, copies * nbytes, block):
                drv.memcpy_dtod(int(weights) + off, int(seed), min(block, copies * nbytes - off))
            x = drv.to_device(rng.standard_normal((8, k), dtype=np.float32).astype(BF16).view(np.uint16))
            y = drv.mem_alloc(8 * n * 4)
            y_ref = drv.mem_alloc(8 * n * 4)
            drv.memset_d8(int(y), 0, 8 * n * 4)
            w_at = lambda i: int(weights) + (i % copies) * nbytes  # noqa: E731
            steps = -(-k // 32)

            for m in MS:
                # eager warm-up of both (cuBLAS picks its kernel on the first call of a shape)
                blas.matmul(int(y), int(x), w_at(0), m, n, k, out_dtype=out_dtype)
                gemv.gemv(int(y), int(x), w_at(0), m, n, k, out_dtype=out_dtype)
                stream.synchronize()
                def ours(impl, kw=None):
                    return lambda i: impl.gemv(int(y), int(x), w_at(i), m, n, k, accumulate=accumulate,
                                                 out_dtype=out_dtype, k_warps=kw)
                sweep = {}
                for kw in K_WARPS:
                    if kw <= steps:   # at least one 32-wide k step per warp
                        sweep[kw] = time_calls(drv, stream, ours(gemv, kw), calls)
                default_kw = gemv.gemv_k_warps(n, k, last=name == "lm_head")
                t_ours = sweep.get(default_kw) or time_calls(drv, stream, ours(gemv, default_kw), calls)
                t_blas = time_calls(drv, stream, lambda i: blas.matmul(
                    int(y), int(x), w_at(i), m, n, k, accumulate=accumulate, out_dtype=out_dtype), calls)
                best_kw = min(sweep, key=sweep.get)
                print(f"{name:8s} M={m}  k_warps: " + "  ".join(f"{kw}:{t:.2f}" for kw, t in sweep.items())
                      + f"  | default {default_kw}, best {best_kw}", flush=True)

                # one plain call of each into separate outputs: how far apart are they?
                gemv.gemv(int(y), int(x), w_at(0), m, n, k, out_dtype=out_dtype)
                blas.matmul(int(y_ref), int(x), w_at(0), m, n, k, out_dtype=out_dtype)
                stream.synchronize()
                dtype = np.float32 if out_dtype == "float32" else BF16
                got, ref = np.empty((m, n), dtype), np.empty((m, n), dtype)
                drv.memcpy_dtoh(got, int(y))
                drv.memcpy_dtoh(ref, int(y_ref))
                got, ref = got.astype(np.float32), ref.astype(np.float32)
                diff = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
                rows.append((name, n, k, m, t_ours, default_kw, sweep[best_kw], best_kw, t_blas, diff))
            weights.free()
            seed.free()
            x.free()
            y.free()
            y_ref.free()
        blas.close()

        print(f"\nGemv vs cuBLAS, GPU time per call inside a CUDA graph (median of {REPS}), weights "
              f"rotated past L2; TB/s = weight bytes / time. Total run {time.perf_counter() - t_start:.0f} s.")
        head = (f"{'shape':8s} {'N x K':>13s} {'MB':>6s} {'M':>2s} {'ours us':>8s} {'ours TB/s':>9s} "
                f"{'cuBLAS us':>9s} {'cuBLAS TB/s':>11s} {'speedup':>7s} {'kw':>3s} {'best kw us':>13s} "
                f"{'diff':>8s}")
        print(head)
        print("-" * len(head))
        for name, n, k, m, t, kw, t_best, best_kw, t_blas, diff in rows:
            mb = n * k * 2 / 1e6
            print(f"{name:8s} {f'{n} x {k}':>13s} {mb:6.1f} {m:2d} {t:8.2f} {mb / t:9.2f} {t_blas:9.2f} "
                  f"{mb / t_blas:11.2f} {t_blas / t:6.2f}x {kw:3d} {f'{t_best:.2f} ({best_kw})':>13s} "
                  f"{diff:8.1e}")
        for m in MS:
            per = {name: (t, tb) for name, _, _, mm, t, _, _, _, tb, _ in rows if mm == m}
            ours = layers * sum(per[s][0] for s in ("qkv", "o", "gate_up", "down")) + per["lm_head"][0]
            theirs = layers * sum(per[s][1] for s in ("qkv", "o", "gate_up", "down")) + per["lm_head"][1]
            print(f"decode step GEMMs at M={m} ({layers} layers + lm_head): ours {ours:.0f} us "
                  f"({1e6 / ours:.0f} steps/s), cuBLAS {theirs:.0f} us ({1e6 / theirs:.0f} steps/s)")
    finally:
        drv.Context.synchronize()
        ctx.pop()


if __name__ == "__main__":
    main()
