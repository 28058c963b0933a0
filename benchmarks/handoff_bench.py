"""What a kernel boundary costs in a decode graph: griddepcontrol.wait against a counter.

    python benchmarks/handoff_bench.py [--preset llama-3.2-1b | --model DIR] [--layers N]
                                       [--context 256] [--repeats 50]

The decode step is a chain of kernels in which each one needs all of the one before it. Today
every boundary is programmatic dependent launch (common.cuh): the next kernel is resident early
and its griddepcontrol.wait returns once the whole previous grid has completed and flushed. A
boundary can instead be a counter in global memory that each block of the producer bumps
(release) when its stores are done and the consumer's warps poll (acquire) — the way a
persistent megakernel hands work on; the engine has it as TINYVLLM_HANDOFF=counter (gpu/handoff.py
says how the counters are wired and reset). This benchmark measures both on chains of stub
kernels (benchmarks/handoff_bench.cu, with the engine's own handoff helpers):

  * the decode layer's five grids (qkv, attention, o, gate_up, down) with the engine's launch
    shapes (gpu/ops.py's rules: block counts, threads, shared memory, so residency is the
    engine's) repeated --layers times, without weights (the boundary alone) and with each
    stage streaming its projection's bytes (K/V for the attention) as the engine does;
  * a uniform chain of one block per SM, the boundary at its simplest.

Each chain is timed three ways inside one CUDA graph: `serial` (plain launches: each kernel
starts when the one before has ended), `pdl` (the engine today), `counter` (PDL launches that
poll counters instead of griddepcontrol.wait). The table gives the GPU time per stage (median of
--repeats replays / stages). Before timing, each graph is replayed with two different inputs and
the chain's end is checked against input + stages (handoff_bench.cu: a block that read before its
producer was done poisons the result); a wrong chain prints WRONG and the script exits 1.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.gpu.handoff import Handoff, counter_plan  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "handoff_bench.cu"
KERNEL = "handoff_stage"
WARMUP = 3
WEIGHT_POOL_BYTES = 1 << 30   # stages stream disjoint slices of this, so L2 (50-60 MB) serves none


@dataclass(frozen=True)
class Stage:
    name: str
    blocks: int
    threads: int
    shared_bytes: int = 0   # dynamic shared memory, asked for only to give the engine's residency
    weight_bytes: int = 0
    busy: int | None = None   # blocks that work (None: all); the rest leave at once

    @property
    def busy_blocks(self) -> int:
        return self.blocks if self.busy is None else self.busy


def decode_layer_stages(config, ops, context: int, with_weights: bool) -> list[Stage]:
    """The fused decode layer's five grids at batch 1, shaped by the engine's own launch rules."""
    from tinyvllm.gpu.ops import DECODE
    h, d, kv_heads = config.hidden_size, config.head_dim, config.num_key_value_heads
    qkv_n, inter = config.q_size + 2 * config.kv_size, config.intermediate_size
    kv_bytes = 2 * context * config.kv_size * 2

    def gemv(name, n, k):
        grid, block, shared = ops.gemv_launch_shape(n, k, ops.decode_k_warps(name, n, k))
        return Stage(name, grid[0], block[0], shared, n * k * 2 if with_weights else 0)

    splits = ops.decode_splits(1, kv_heads)   # the grid's; a short context works in one (attention_decode.cu)
    used = 1 if context <= DECODE["ONE_SPLIT_TOKENS"] else min(splits, math.ceil(context / DECODE["MIN_SPLIT_TOKENS"]))
    attention = Stage("attention", kv_heads * splits, DECODE["THREADS"], DECODE["SMEM_BYTES_PER_DIM"] * d,
                      kv_bytes if with_weights else 0, busy=kv_heads * used)
    return [gemv("qkv", qkv_n, h), attention, gemv("o", h, config.q_size),
            gemv("gate_up", 2 * inter, h), gemv("down", h, inter)]


def build(kernel, stages: list[Stage], mode: str, stream, weights, counters, buffers, first_in):
    """Enqueue one pass of the chain on stream (inside a capture). mode: serial | pdl | counter."""
    plan = counter_plan([s.blocks for s in stages]) if mode == "counter" else None
    counter_at = lambda i: 0 if i is None else int(counters) + 4 * i   # noqa: E731
    width = min(2048, min(s.busy_blocks * s.threads for s in stages))
    offset = 0
    for i, stage in enumerate(stages):
        quads = stage.weight_bytes // 16 // stage.busy_blocks
        if offset + quads * 16 * stage.busy_blocks > WEIGHT_POOL_BYTES:
            offset = 0
        src = first_in if i == 0 else buffers[i - 1]
        h = plan[i] if plan else Handoff(None, 0, None, None)
        args = (buffers[i], src, width, int(weights) + offset, quads, counter_at(h.wait), h.wait_count,
                counter_at(h.done), counter_at(h.reset), stage.busy_blocks)
        kernel.launch((stage.blocks, 1, 1), (stage.threads, 1, 1), stream.handle, args, stage.shared_bytes,
                      pdl=mode != "serial")
        offset += quads * 16 * stage.busy_blocks
    return width


def run_chain(drv, kernel, stages: list[Stage], repeats: int) -> dict[str, float | None]:
    """{mode: µs per stage, None if the chain's result was wrong}."""
    from tinyvllm.gpu.graphs import CudaGraph
    stream = drv.Stream()
    most = max(s.blocks * s.threads for s in stages)
    buffers = [drv.mem_alloc(4 * most) for _ in stages]
    first_in = drv.mem_alloc(4 * most)
    weights = drv.mem_alloc(WEIGHT_POOL_BYTES)
    drv.memset_d32(weights, 0, WEIGHT_POOL_BYTES // 4)
    counters = drv.mem_alloc(4 * len(stages))
    result: dict[str, float | None] = {}
    for mode in ("serial", "pdl", "counter"):
        drv.memset_d32(counters, 0, len(stages))
        with CudaGraph.capture(stream) as graph:
            width = build(kernel, stages, mode, stream, weights, counters, buffers, first_in)
        try:
            ok = True
            for value in (1.0, 7.0):   # two inputs: a read of the replay before would show
                drv.memcpy_htod(first_in, np.full(most, value, np.float32))
                graph.launch(stream)
                stream.synchronize()
                end = np.empty(width, np.float32)
                drv.memcpy_dtoh(end, buffers[-1])
                ok &= bool(np.all(end == value + len(stages)))
            for _ in range(WARMUP):
                graph.launch(stream)
            start, stop = drv.Event(), drv.Event()
            start.record(stream)
            for _ in range(repeats):
                graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            result[mode] = stop.time_since(start) * 1e3 / repeats / len(stages) if ok else None
        finally:
            graph.close()
    for b in (*buffers, first_in, weights, counters):
        b.free()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--preset", default="llama-3.2-1b")
    which.add_argument("--model", help="a model directory (its config.json gives the shapes)")
    ap.add_argument("--layers", type=int, default=None, help="decode layers in the chain (default: the model's)")
    ap.add_argument("--context", type=int, default=256, help="tokens of K/V the attention stage streams")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()

    from tinyvllm.checkpoint.model_writer import preset_config
    from tinyvllm.config import ModelConfig
    from tinyvllm.gpu import kernels
    from tinyvllm.gpu.driver import CudaDevice, check, libcuda
    from tinyvllm.gpu.ops import GpuOps

    config = ModelConfig.from_pretrained(args.model) if args.model else preset_config(args.preset)
    layers = args.layers or config.num_hidden_layers
    device = CudaDevice()
    with device.active():
        drv = device.drv
        library = kernels.KernelLibrary()
        ops = GpuOps(library, num_sms=device.num_sms)
        module = kernels.load_module(SOURCE, library.arch, library.options)
        handle = ctypes.c_void_p()
        check(libcuda().cuModuleGetFunction(ctypes.byref(handle), module, KERNEL.encode()), KERNEL)
        kernel = kernels.Kernel(KERNEL, handle, kernels.kernel_signatures(str(SOURCE))[KERNEL],
                                kernels.waits_for_producer(str(SOURCE)))
        chains = [(f"decode layer x{layers}, no weights", decode_layer_stages(config, ops, args.context, False) * layers),
                  (f"decode layer x{layers}, weights", decode_layer_stages(config, ops, args.context, True) * layers),
                  (f"{device.num_sms} blocks x 256, x{5 * layers}", [Stage("uniform", device.num_sms, 256)] * (5 * layers))]
        most_shared = max(s.shared_bytes for _, chain in chains for s in chain)
        kernel.set_max_dynamic_shared_bytes(most_shared)
        print(f"{device.name}, {config.num_hidden_layers}-layer model, hidden {config.hidden_size}; one layer's grids:")
        for s in chains[1][1][:5]:
            print(f"  {s.name:9s} {s.blocks:5d} blocks ({s.busy_blocks} busy) x {s.threads:4d} threads, "
                  f"{s.shared_bytes / 1024:6.1f} KB shared, "
                  f"{s.weight_bytes / 1e6:6.2f} MB")
        print()
        print("| chain | serial µs/stage | pdl µs/stage | counter µs/stage | counter - pdl, µs per step |")
        print("|---|---|---|---|---|")
        wrong = False
        for label, chain in chains:
            r = run_chain(drv, kernel, chain, args.repeats)
            cells = ["WRONG" if r[m] is None else f"{r[m]:.2f}" for m in ("serial", "pdl", "counter")]
            wrong |= any(r[m] is None for m in r)
            step = "-" if None in (r["pdl"], r["counter"]) else f"{(r['counter'] - r['pdl']) * len(chain):+.1f}"
            print(f"| {label} | {' | '.join(cells)} | {step} |")
    if wrong:
        sys.exit("a chain's result was wrong: a stage read its input before its producer was done")


if __name__ == "__main__":
    main()
