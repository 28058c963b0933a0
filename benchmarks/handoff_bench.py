"""What a kernel boundary costs in a decode graph: griddepcontrol.wait against a counter.

    python benchmarks/handoff_bench.py [--preset llama-3.2-1b | --model DIR] [--layers N]
                                       [--context 256] [--repeats 50] [--counter-stride 128]
                                       [--variant NAME=INT[,NAME=INT] ...]

The decode step is a chain of kernels in which each one needs all of the one before it. Every
boundary is programmatic dependent launch (common.cuh): the next kernel is resident early and
its griddepcontrol.wait returns once the whole previous grid has completed and flushed. A
boundary can instead be a counter in global memory that each block of the producer bumps
(release) when its stores are done and the consumer polls (acquire) — the way a persistent
megakernel hands work on. This benchmark measures both on chains of stub kernels
(benchmarks/handoff_bench.cu says how the counters are bumped, polled and reset):

  * the decode layer's five grids (qkv, attention, o, gate_up, down) with the engine's launch
    shapes (gpu/ops.py's rules: block counts, threads, shared memory, so residency is the
    engine's) repeated --layers times, without weights (the boundary alone) and with each
    stage streaming its projection's bytes (K/V for the attention) as the engine does;
  * a uniform chain of one block per SM, the boundary at its simplest.

Each chain is timed inside one CUDA graph as `serial` (plain launches: each kernel starts when
the one before has ended), `pdl` (the engine), `counter` (PDL launches that poll counters
instead of griddepcontrol.wait), and `counter` again for each --variant of the stub's polling
constants. The table gives the GPU time per stage (--repeats back-to-back replays between two events, / stages).
Before timing, each graph is replayed with two different inputs and the chain's end is checked
against input + stages (a block that read before its producer was done poisons the result); a
wrong chain prints WRONG and the script exits 1.
Last, one table for the other way to drop the grid boundary: the whole chain in ONE launch of
a single thread-block cluster (8 blocks, or 16 where the GPU allows a non-portable size),
stages separated by a cluster barrier (cluster_chain), without weights and with the layer's
average bytes per stage spread over the cluster's blocks: the sync a cluster-persistent decode
step would pay per stage, and the bandwidth so few SMs pull.
Session 14 (H100, docs/perf-notes.md): PDL 2.58 µs per trivial stage; the counter 0.24-0.32 µs
slower at best (1.7 µs at first, from polling contention), so the engine keeps griddepcontrol.wait;
one cluster 2.0-2.2 µs per stage, but 16 SMs pull only 0.47 TB/s.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


@dataclass(frozen=True)
class Handoff:
    """How one stage of a counter chain waits and signals: counter indices (None: not used).
    wait None means griddepcontrol.wait."""
    wait: int | None
    wait_count: int
    done: int | None
    reset: int | None


def counter_plan(blocks: list[int]) -> list[Handoff]:
    """The counters of a chain of K = len(blocks) stages (counter i = stage i's blocks done).
    The first and the last stage wait with griddepcontrol.wait; stage i in between polls counter
    i - 1 until it holds blocks[i - 1]. Stages 0 .. K - 3 bump their counter (a stage nobody polls
    bumps none). Counter i may be zeroed once every block of stage i + 1 has passed its poll of
    it, which stage i + 2 knows (its own handoff passed only once every block of stage i + 1 was
    done), so stage i + 2 zeroes it, inside the same pass, and every pass leaves the counters at
    zero. Why not the last stage by counter too: the counter it polls could then be zeroed only
    by the next replay's first stage, and under PDL the next replay's later stages may poll
    before that stage runs (the model in tests/test_handoff_bench.py finds that schedule)."""
    k = len(blocks)
    if k < 3:
        raise ValueError(f"a counter chain needs at least 3 stages, got {k}")
    polled = lambda i: 1 <= i <= k - 2   # noqa: E731
    return [Handoff(wait=i - 1 if polled(i) else None, wait_count=blocks[i - 1] if polled(i) else 0,
                    done=i if polled(i + 1) else None, reset=i - 2 if i >= 2 else None)
            for i in range(k)]


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


def build(kernel, stages: list[Stage], mode: str, stream, weights, counters, buffers, first_in, stride: int):
    """Enqueue one pass of the chain on stream (inside a capture). mode: serial | pdl | counter."""
    plan = counter_plan([s.blocks for s in stages]) if mode == "counter" else None
    counter_at = lambda i: 0 if i is None else int(counters) + stride * i   # noqa: E731
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


def replay_us(drv, graph, stream, repeats: int) -> float:
    """GPU µs of one replay: WARMUP replays, then `repeats` back to back between two events."""
    for _ in range(WARMUP):
        graph.launch(stream)
    start, stop = drv.Event(), drv.Event()
    start.record(stream)
    for _ in range(repeats):
        graph.launch(stream)
    stop.record(stream)
    stop.synchronize()
    return stop.time_since(start) * 1e3 / repeats


def chain_is_right(drv, graph, stream, first_in, fill: int, last_out, width: int, stages: int) -> bool:
    """Replay the graph with two inputs (fill floats of `first_in` each time; a stage that read the
    replay before would show) and check the chain's end: width floats of last_out = input + stages."""
    ok = True
    for value in (1.0, 7.0):
        drv.memcpy_htod(first_in, np.full(fill, value, np.float32))
        graph.launch(stream)
        stream.synchronize()
        end = np.empty(width, np.float32)
        drv.memcpy_dtoh(end, last_out)
        ok &= bool(np.all(end == value + stages))
    return ok


def run_chain(drv, runs: list[tuple[str, object, str]], stages: list[Stage], repeats: int,
              stride: int) -> dict[str, float | None]:
    """runs: (column, stub kernel, mode) -> {column: µs per stage, None if the chain's result was wrong}."""
    from tinyvllm.gpu.graphs import CudaGraph
    stream = drv.Stream()
    most = max(s.blocks * s.threads for s in stages)
    buffers = [drv.mem_alloc(4 * most) for _ in stages]
    first_in = drv.mem_alloc(4 * most)
    weights = drv.mem_alloc(WEIGHT_POOL_BYTES)
    drv.memset_d32(weights, 0, WEIGHT_POOL_BYTES // 4)
    counters = drv.mem_alloc(stride * len(stages))
    result: dict[str, float | None] = {}
    for column, kernel, mode in runs:
        drv.memset_d32(counters, 0, stride * len(stages) // 4)
        with CudaGraph.capture(stream) as graph:
            width = build(kernel, stages, mode, stream, weights, counters, buffers, first_in, stride)
        try:
            ok = chain_is_right(drv, graph, stream, first_in, most, buffers[-1], width, len(stages))
            result[column] = replay_us(drv, graph, stream, repeats) / len(stages) if ok else None
        finally:
            graph.close()
    for b in (*buffers, first_in, weights, counters):
        b.free()
    return result


def run_cluster_chain(drv, kernel, ctas: int, stages: int, width: int, stage_bytes: int,
                      repeats: int) -> tuple[float | None, float]:
    """(µs per stage or None if wrong, weight TB/s) of cluster_chain: `stages` stages of one
    `ctas`-block cluster, each streaming stage_bytes of weights in all."""
    from tinyvllm.gpu.graphs import CudaGraph
    stream = drv.Stream()
    a, b = drv.mem_alloc(4 * width), drv.mem_alloc(4 * width)
    weights = drv.mem_alloc(WEIGHT_POOL_BYTES)
    drv.memset_d32(weights, 0, WEIGHT_POOL_BYTES // 4)
    quads = stage_bytes // 16 // ctas
    args = (a, b, width, stages, weights, quads, WEIGHT_POOL_BYTES // 16)
    with CudaGraph.capture(stream) as graph:
        kernel.launch((ctas, 1, 1), (256, 1, 1), stream.handle, args, cluster=ctas)
    try:
        ok = chain_is_right(drv, graph, stream, a, width, a if stages % 2 == 0 else b, width, stages)
        us = replay_us(drv, graph, stream, repeats) / stages
    finally:
        graph.close()
        for buf in (a, b, weights):
            buf.free()
    return (us if ok else None), quads * 16 * ctas / us / 1e6


def load_stub(kernels, library, variant: dict[str, int], workdir: Path) -> dict:
    """{kernel name: Kernel} of handoff_bench.cu, compiled once with `variant`'s constants rewritten
    (constant_sweep's rewrite_constants; {}: as it is)."""
    from constant_sweep import rewrite_constants

    source = SOURCE
    if variant:
        source = Path(tempfile.mkdtemp(dir=workdir)) / SOURCE.name
        source.write_text(rewrite_constants(SOURCE.read_text(), variant))
    module = kernels.load_module(source, library.arch, library.options)
    return {name: kernels.Kernel.from_module(module, SOURCE.name, name, signature,
                                             kernels.waits_for_producer(str(SOURCE)))
            for name, signature in kernels.kernel_signatures(str(SOURCE)).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--preset", default="llama-3.2-1b")
    which.add_argument("--model", help="a model directory (its config.json gives the shapes)")
    ap.add_argument("--layers", type=int, default=None, help="decode layers in the chain (default: the model's)")
    ap.add_argument("--context", type=int, default=256, help="tokens of K/V the attention stage streams")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--counter-stride", type=int, default=128,
                    help="bytes between two stages' counters (128: one L2 line each; 4: packed)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=INT[,NAME=INT]",
                    help="also time the counter handoff with these constants of handoff_bench.cu rewritten "
                         "(e.g. POLL_PER_BLOCK=0,POLL_SLEEP_NS=0); repeatable")
    args = ap.parse_args()

    from constant_sweep import parse_variant

    from tinyvllm.checkpoint.model_writer import preset_config
    from tinyvllm.config import ModelConfig
    from tinyvllm.gpu import driver, kernels
    from tinyvllm.gpu.driver import CudaDevice
    from tinyvllm.gpu.ops import GpuOps

    variants = [(spec, parse_variant(spec)) for spec in args.variant]
    config = ModelConfig.from_pretrained(args.model) if args.model else preset_config(args.preset)
    layers = args.layers or config.num_hidden_layers
    device = CudaDevice()
    with device.active(), tempfile.TemporaryDirectory() as workdir:
        drv = device.drv
        library = kernels.KernelLibrary()
        ops = GpuOps(library, num_sms=device.num_sms)
        stubs = load_stub(kernels, library, {}, Path(workdir))
        kernel = stubs[KERNEL]
        runs = [("serial", kernel, "serial"), ("pdl", kernel, "pdl"), ("counter", kernel, "counter"),
                *[(f"counter {spec}", load_stub(kernels, library, v, Path(workdir))[KERNEL], "counter")
                  for spec, v in variants]]
        chains = [(f"decode layer x{layers}, no weights", decode_layer_stages(config, ops, args.context, False) * layers),
                  (f"decode layer x{layers}, weights", decode_layer_stages(config, ops, args.context, True) * layers),
                  (f"{device.num_sms} blocks x 256, x{5 * layers}", [Stage("uniform", device.num_sms, 256)] * (5 * layers))]
        most_shared = max(s.shared_bytes for _, chain in chains for s in chain)
        for _, k, _ in runs:
            k.set_max_dynamic_shared_bytes(most_shared)
        print(f"{device.name}, {config.num_hidden_layers}-layer model, hidden {config.hidden_size}; one layer's grids:")
        for s in chains[1][1][:5]:
            print(f"  {s.name:9s} {s.blocks:5d} blocks ({s.busy_blocks} busy) x {s.threads:4d} threads, "
                  f"{s.shared_bytes / 1024:6.1f} KB shared, "
                  f"{s.weight_bytes / 1e6:6.2f} MB")
        print("\nµs per stage (GPU time of --repeats back-to-back replays / replays / stages); in brackets, per step against pdl:")
        columns = [c for c, _, _ in runs]
        print("| chain | " + " | ".join(columns) + " |")
        print("|---|" + "---|" * len(columns))
        wrong = False
        for label, chain in chains:
            r = run_chain(drv, runs, chain, args.repeats, args.counter_stride)
            wrong |= any(v is None for v in r.values())
            cells = []
            for c in columns:
                if r[c] is None:
                    cells.append("WRONG")
                elif c.startswith("counter") and r["pdl"] is not None:
                    cells.append(f"{r[c]:.2f} ({(r[c] - r['pdl']) * len(chain):+.0f} µs)")
                else:
                    cells.append(f"{r[c]:.2f}")
            print(f"| {label} | " + " | ".join(cells) + " |")
        # one cluster instead of a grid per stage: the sync and the bandwidth of a few SMs
        cluster = stubs["cluster_chain"]
        cluster_sizes = (8, 16)
        cluster.set_attribute(driver.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        layer = decode_layer_stages(config, ops, args.context, True)
        stage_bytes = sum(st.weight_bytes for st in layer) // len(layer)
        width = min(2048, config.hidden_size)
        print(f"\none cluster, {5 * layers} stages, a cluster barrier between them "
              f"(weights: the layer's average, {stage_bytes / 1e6:.2f} MB a stage):")
        print("| cluster blocks | µs/stage, no weights | µs/stage, weights | weights TB/s |")
        print("|---|---|---|---|")
        for ctas in cluster_sizes:
            try:
                bare, _ = run_cluster_chain(drv, cluster, ctas, 5 * layers, width, 0, args.repeats)
                loaded, tbs = run_cluster_chain(drv, cluster, ctas, 5 * layers, width, stage_bytes, args.repeats)
            except driver.CudaDriverError as e:   # e.g. no room for a cluster of 16 on this GPU
                print(f"| {ctas} | {e} | | |")
                continue
            wrong |= bare is None or loaded is None
            cells = ["WRONG" if v is None else f"{v:.2f}" for v in (bare, loaded)]
            print(f"| {ctas} | {cells[0]} | {cells[1]} | {tbs:.2f} |")
    if wrong:
        sys.exit("a chain's result was wrong: a stage read its input before its producer was done")


if __name__ == "__main__":
    main()
