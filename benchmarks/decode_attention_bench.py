"""Decode attention (cuda/attention_decode.cu) alone: GPU µs per layer and effective KV bandwidth.

    python3 benchmarks/decode_attention_bench.py [--batch 1 8 64 256] [--context 256 1024 4096]

Shapes: Llama-3.2-1B (32 q heads, 8 kv heads, head_dim 64) and Llama-3.1-8B (32 / 8 / 128), block
size 16, every sequence at the same context, pages shuffled over the cache as a running engine
leaves them. Each launch goes through `GpuOps.attention_decode` with the launcher's own split
choice, as the model calls it. R launches are captured into one CUDA graph and rotate over
enough copies of the layer's cache (>= 256 MB in all, at most 16 = the 1B model's layers) that
L2 does not serve the large cases (at batch 1 and short contexts all copies fit in L2, which a
real step, streaming ~70 MB of weights between two layers' attention, would not allow); the graph is replayed 3 times to warm up,
then 20 times between CUDA events; a launch's time is the median replay / R.
"effective TB/s" = K + V bytes the batch's contexts occupy / time (q, tables, output ignored).
Works on any branch whose launcher has this signature (for a before/after comparison, run it
with PYTHONPATH pointing at the other checkout).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"1B": (32, 8, 64), "8B": (32, 8, 128), "135M": (9, 3, 64)}   # q heads, kv heads, head_dim
BLOCK_SIZE = 16
ROTATE_BYTES = 256 << 20
MAX_COPIES = 16
MIN_CALLS = 16
WARMUP, REPS = 3, 20


def bench_case(drv, ops, stream, rng, hq, hkv, d, batch, context, splits=None) -> tuple[float, float, int]:
    """(µs per launch, effective TB/s, grid splits) for one shape, batch and context; splits:
    the grid's split count (None: the launcher's choice, as the model runs it)."""
    import ml_dtypes

    from tinyvllm.gpu.graphs import CudaGraph
    from tinyvllm.gpu.ops import MAX_DECODE_SPLITS
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    cache_bytes = num_blocks * BLOCK_SIZE * hkv * d * 2          # one of K, V
    kv_bytes = 2 * batch * context * hkv * d * 2                  # what one launch must read
    copies = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / (2 * cache_bytes))))
    calls = max(copies, MIN_CALLS)
    bufs = []

    def alloc(nbytes):
        bufs.append(drv.mem_alloc(max(nbytes, 16)))
        return bufs[-1]

    def upload(a):
        buf = alloc(a.nbytes)
        drv.memcpy_htod(buf, np.ascontiguousarray(a))
        return buf

    # K/V contents do not change the kernel's work: fill with bf16 0.0625 (0x3D80), cheaply
    caches = []
    for _ in range(copies):
        k, v = alloc(cache_bytes), alloc(cache_bytes)
        drv.memset_d16(k, 0x3D80, cache_bytes // 2)
        drv.memset_d16(v, 0x3D80, cache_bytes // 2)
        caches.append((k, v))
    q = upload((rng.standard_normal((batch, hq * d)) * 0.5).astype(ml_dtypes.bfloat16).view(np.uint16))
    tables = upload(rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq))
    width = upload(np.array([blocks_per_seq], np.int32))
    ctx = upload(np.full(batch, context, np.int32))
    out = alloc(batch * hq * d * 2)
    part_out = alloc(batch * hq * MAX_DECODE_SPLITS * d * 4)
    part_ml = alloc(batch * hq * MAX_DECODE_SPLITS * 2 * 4)
    counters = upload(np.zeros(batch * hkv, np.int32))
    splits = splits or ops.decode_splits(batch, hkv)

    def launch(i):
        k, v = caches[i % copies]
        ops.attention_decode(out, part_out, part_ml, counters, q, hq * d, k, v, tables, width, ctx,
                             num_seqs=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             block_size=BLOCK_SIZE, scale=1 / math.sqrt(d), splits=splits)

    launch(0)                       # outside the capture: compile, load, shared-memory opt-in
    stream.synchronize()
    with CudaGraph.capture(stream) as graph:
        for i in range(calls):
            launch(i)
    try:
        for _ in range(WARMUP):
            graph.launch(stream)
        events = [(drv.Event(), drv.Event()) for _ in range(REPS)]
        for start, end in events:
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
        events[-1][1].synchronize()
        us = statistics.median(end.time_since(start) for start, end in events) * 1e3 / calls
    finally:
        graph.close()
        for b in bufs:
            b.free()
    return us, kv_bytes / us / 1e6, splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--shape", nargs="+", default=["1B", "8B"], choices=list(SHAPES))
    ap.add_argument("--splits", type=int, nargs="+", default=[0],
                    help="grid split counts to time (0: the launcher's choice, the default)")
    args = ap.parse_args()
    import pycuda.driver as drv

    from tinyvllm.gpu.driver import CudaDevice
    from tinyvllm.gpu.kernels import KernelLibrary
    from tinyvllm.gpu.ops import GpuOps
    t0 = time.perf_counter()
    device = CudaDevice()
    with device.active():
        stream = drv.Stream()
        ops = GpuOps(KernelLibrary(), stream=stream, blas=None, num_sms=device.num_sms)
        print(f"{device.name}, {device.num_sms} SMs; setup {time.perf_counter() - t0:.1f} s")
        rng = np.random.default_rng(0)
        print(f"{'shape':<5} {'batch':>6} {'context':>8} {'splits':>7} {'µs/layer':>10} {'eff. TB/s':>10}")
        for shape in args.shape:
            hq, hkv, d = SHAPES[shape]
            for batch in args.batch:
                for context in args.context:
                    for want in args.splits:
                        us, tbs, splits = bench_case(drv, ops, stream, rng, hq, hkv, d, batch, context, want or None)
                        print(f"{shape:<5} {batch:>6} {context:>8} {splits:>7} {us:>10.2f} {tbs:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
