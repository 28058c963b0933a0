"""Prefill attention (cuda/attention_prefill.cu, through GpuOps): GPU time per layer and TFLOP/s
at the shapes a prefill runs, with a spot check against float32 attention computed here.

    source .gpu/gpu-env.sh && python3 benchmarks/prefill_attention_bench.py

GPU time per layer: LAYERS calls captured into one CUDA graph (gemv_bench.Graph), replayed
3 + 50 times between CUDA events, median replay / LAYERS. Every call reads the same paged cache
(block size 16, shuffled block tables, fresh prompts: no cached prefix), as a prefill layer reads
the K/V that rope_write_kv has just written, mostly from L2. Shapes: Llama-3.2-1B heads (32 q, 8 kv,
d 64) and Llama-3.1-8B heads (32 q, 8 kv, d 128); batches 16 x 512, 1 x 8192, 64 x 128 tokens.
TFLOP/s counts the causal work only: 4 * d * q_heads * sum over tokens of (position + 1).
`diff` = max |kernel - twin| / max |twin| over the first sequence's last CHECK_ROWS query rows
(each attending to the whole prompt), twin = reference/kernels.py's float32 causal_gqa_attention
over that sequence's K/V gathered through its block table: the kernel rounds P to bf16 for P V
and writes bf16, so ~1e-2 is agreement (tests/test_gpu_kernels.py holds the kernel to the twin
with derived bounds; this checks the timed launch).
"""
from __future__ import annotations

import math
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
CHECK_ROWS = 64


def main() -> None:
    import ml_dtypes
    import pycuda.driver as drv
    from gemv_bench import time_calls

    from tinyvllm.gpu.kernels import KernelLibrary
    from tinyvllm.gpu.ops import GpuOps
    from tinyvllm.reference.kernels import causal_gqa_attention, gather_kv

    bf16 = ml_dtypes.bfloat16
    drv.init()
    device = drv.Device(0)
    ctx = device.retain_primary_context()
    ctx.push()
    try:
        stream = drv.Stream()
        ops = GpuOps(KernelLibrary(), stream, blas=None)
        rng = np.random.default_rng(0)
        rows = []
        for name, hq, hkv, d in HEADS:
            for num_seqs, length in BATCHES:
                tokens = num_seqs * length
                blocks_per_seq = -(-length // BLOCK_SIZE)
                num_blocks = num_seqs * blocks_per_seq
                tables = rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, blocks_per_seq)
                cache_size = num_blocks * BLOCK_SIZE * hkv * d
                host = [rng.standard_normal(n, dtype=np.float32).astype(bf16) for n in (tokens * hq * d, cache_size, cache_size)]
                # PyCUDA's to_device cannot take the bf16 dtype itself: it gets the raw 16-bit words
                q, k_cache, v_cache = (drv.to_device(h.view(np.uint16)) for h in host)
                out = drv.mem_alloc(tokens * hq * d * 2)
                d_tables = drv.to_device(tables)
                d_width = drv.to_device(np.array([blocks_per_seq], np.int32))
                d_qs = drv.to_device((np.arange(num_seqs + 1) * length).astype(np.int32))
                d_ctx = drv.to_device(np.full(num_seqs, length, np.int32))
                args = (int(q), hq * d, int(k_cache), int(v_cache), int(d_tables), int(d_width),
                        int(d_qs), int(d_ctx))

                def launch(_i, args=args, num_seqs=num_seqs, length=length, hq=hq, hkv=hkv, d=d, out=out):
                    ops.attention_prefill(int(out), *args, num_seqs=num_seqs, max_query_len=length,
                                          num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                          block_size=BLOCK_SIZE, scale=1 / math.sqrt(d))

                launch(0)
                stream.synchronize()
                got = np.empty(tokens * hq * d, bf16)
                drv.memcpy_dtoh(got, int(out))
                got = got.astype(np.float32).reshape(tokens, hq, d)
                check = np.arange(max(0, length - CHECK_ROWS), length)
                k_seq, v_seq = (gather_kv(h.reshape(num_blocks, BLOCK_SIZE, hkv, d), tables[0], length)
                                for h in host[1:])
                want = causal_gqa_attention(host[0].reshape(tokens, hq, d)[check], k_seq, v_seq, check,
                                            1 / math.sqrt(d))
                diff = float(np.abs(got[check] - want).max() / max(np.abs(want).max(), 1e-30))
                t = time_calls(drv, stream, launch, LAYERS)
                flops = 4 * d * hq * num_seqs * (length * (length + 1) // 2)
                rows.append((name, d, num_seqs, length, t, flops, diff))
                print(f"{name} d{d} {num_seqs} x {length}: {t:.1f} us, diff {diff:.2e}", flush=True)
                for a in (q, k_cache, v_cache, out, d_tables, d_width, d_qs, d_ctx):
                    a.free()

        print(f"\nPrefill attention, GPU us per layer inside a CUDA graph ({device.name()}, "
              f"{ops.num_sms} SMs, block size {BLOCK_SIZE}, 32 q / 8 kv heads)")
        head = f"{'heads':5s} {'d':>3s} {'batch':>10s} {'us':>9s} {'TFLOP/s':>8s} {'16 layers ms':>12s} {'diff':>8s}"
        print(head)
        print("-" * len(head))
        for name, d, num_seqs, length, t, flops, diff in rows:
            print(f"{name:5s} {d:3d} {f'{num_seqs} x {length}':>10s} {t:9.1f} {flops / t / 1e6:8.1f} "
                  f"{LAYERS * t / 1e3:12.2f} {diff:8.2e}")
    finally:
        ctx.pop()


if __name__ == "__main__":
    main()
