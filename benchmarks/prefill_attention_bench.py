"""Prefill attention, tensor-core kernel (cuda/attention_prefill.cu, through GpuOps) vs the
CUDA-core kernel it replaced (benchmarks/attention_prefill_simt.cu, compiled here only).

    source .gpu/gpu-env.sh && python3 benchmarks/prefill_attention_bench.py

GPU time per layer: LAYERS calls captured into one CUDA graph (gemv_bench.Graph), replayed
3 + 50 times between CUDA events, median replay / LAYERS. Every call reads the same paged cache
(block size 16, shuffled block tables, fresh prompts: no cached prefix), as a prefill layer reads
the K/V that rope_write_kv has just written, mostly from L2. Shapes: Llama-3.2-1B heads (32 q, 8 kv,
d 64) and Llama-3.1-8B heads (32 q, 8 kv, d 128); batches 16 x 512, 1 x 8192, 64 x 128 tokens.
TFLOP/s counts the causal work only: 4 * d * q_heads * sum over tokens of (position + 1).
`diff` = max |new - old| / max |old| on one call (both are bf16 kernels: ~1e-2 is agreement).
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

HEADS = [("1B", 32, 8, 64), ("8B", 32, 8, 128)]
BATCHES = [(16, 512), (1, 8192), (64, 128)]
LAYERS = 16
BLOCK_SIZE = 16
SIMT_SOURCE = HERE / "attention_prefill_simt.cu"


def simt_kernels(arch: str):
    """The old kernels, compiled from the benchmark's copy, and their BLOCK_Q."""
    from pycuda.compiler import SourceModule

    from tinyvllm.gpu.kernels import CUDA_DIR
    source = SIMT_SOURCE.read_text()
    module = SourceModule(source, arch=arch, no_extern_c=True, options=["-std=c++17", "-O3"],
                          include_dirs=[str(CUDA_DIR)])
    block_q = int(re.search(r"constexpr int BLOCK_Q = (\d+);", source).group(1))
    fns = {}
    for d in (64, 128):
        fn = module.get_function(f"attention_prefill_simt_d{d}")
        fn.prepare("PPiPPPPPPiiif")
        fns[d] = fn
    return fns, block_q


def random_bf16(drv, rng, n: int):
    """A device buffer of n standard-normal bf16 values (PyCUDA's to_device cannot take the
    bf16 dtype itself: it gets the raw 16-bit words)."""
    import ml_dtypes
    return drv.to_device(rng.standard_normal(n, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


def main() -> None:
    import ml_dtypes
    import pycuda.driver as drv
    from gemv_bench import time_calls

    from tinyvllm.gpu.kernels import KernelLibrary
    from tinyvllm.gpu.ops import GpuOps

    bf16 = ml_dtypes.bfloat16
    drv.init()
    device = drv.Device(0)
    ctx = device.retain_primary_context()
    ctx.push()
    try:
        stream = drv.Stream()
        library = KernelLibrary()
        ops = GpuOps(library, stream, blas=None)
        old, old_block_q = simt_kernels(library.arch)
        rng = np.random.default_rng(0)
        rows = []
        for name, hq, hkv, d in HEADS:
            for num_seqs, length in BATCHES:
                tokens = num_seqs * length
                blocks_per_seq = -(-length // BLOCK_SIZE)
                num_blocks = num_seqs * blocks_per_seq
                tables = rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, blocks_per_seq)
                cache_size = num_blocks * BLOCK_SIZE * hkv * d
                q, k_cache, v_cache = (random_bf16(drv, rng, n) for n in (tokens * hq * d, cache_size, cache_size))
                out_new, out_old = drv.mem_alloc(tokens * hq * d * 2), drv.mem_alloc(tokens * hq * d * 2)
                d_tables = drv.to_device(tables)
                d_width = drv.to_device(np.array([blocks_per_seq], np.int32))
                d_qs = drv.to_device((np.arange(num_seqs + 1) * length).astype(np.int32))
                d_ctx = drv.to_device(np.full(num_seqs, length, np.int32))
                scale = 1 / math.sqrt(d)
                args = (int(q), hq * d, int(k_cache), int(v_cache), int(d_tables), int(d_width),
                        int(d_qs), int(d_ctx))

                def new(_i, out=out_new, args=args, num_seqs=num_seqs, length=length, hq=hq, hkv=hkv, d=d):
                    ops.attention_prefill(int(out), *args, num_seqs=num_seqs, max_query_len=length,
                                          num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                          block_size=BLOCK_SIZE, scale=1 / math.sqrt(d))

                grid_old = (-(-length // old_block_q), num_seqs, hq)
                block_old = (old_block_q * (d // 64), 1, 1)
                old_args = (int(out_old), *args, BLOCK_SIZE, hkv, hq // hkv, scale)

                def simt(_i, fn=old[d], grid=grid_old, block=block_old, old_args=old_args):
                    fn.prepared_async_call(grid, block, stream, *old_args)

                new(0)
                simt(0)
                stream.synchronize()
                got, want = np.empty(tokens * hq * d, bf16), np.empty(tokens * hq * d, bf16)
                drv.memcpy_dtoh(got, int(out_new))
                drv.memcpy_dtoh(want, int(out_old))
                got, want = got.astype(np.float32), want.astype(np.float32)
                diff = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
                t_new = time_calls(drv, stream, new, LAYERS)
                t_old = time_calls(drv, stream, simt, LAYERS)
                flops = 4 * d * hq * num_seqs * (length * (length + 1) // 2)
                rows.append((name, d, num_seqs, length, t_new, t_old, flops, diff))
                print(f"{name} d{d} {num_seqs} x {length}: new {t_new:.1f} us, old {t_old:.1f} us, "
                      f"diff {diff:.2e}", flush=True)
                for a in (q, k_cache, v_cache, out_new, out_old, d_tables, d_width, d_qs, d_ctx):
                    a.free()

        print(f"\nPrefill attention, GPU us per layer inside a CUDA graph ({device.name()}, "
              f"{ops.num_sms} SMs, block size {BLOCK_SIZE}, 32 q / 8 kv heads)")
        head = (f"{'heads':5s} {'d':>3s} {'batch':>10s} {'new us':>9s} {'TFLOP/s':>8s} {'old us':>9s} "
                f"{'TFLOP/s':>8s} {'speedup':>7s} {'16 layers ms':>12s} {'diff':>8s}")
        print(head)
        print("-" * len(head))
        for name, d, num_seqs, length, t_new, t_old, flops, diff in rows:
            print(f"{name:5s} {d:3d} {f'{num_seqs} x {length}':>10s} {t_new:9.1f} {flops / t_new / 1e6:8.1f} "
                  f"{t_old:9.1f} {flops / t_old / 1e6:8.1f} {t_old / t_new:6.1f}x {LAYERS * t_new / 1e3:12.2f} "
                  f"{diff:8.2e}")
    finally:
        ctx.pop()


if __name__ == "__main__":
    main()
