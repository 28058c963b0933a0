"""Where a decode step's time goes, on the GPU: whole-step wall time for eager launches vs
CUDA-graph replay at several batch sizes, the GPU time of a replay alone, and per-op GPU time
(each op's launches of one step captured into a graph of their own and timed with CUDA events).

    python benchmarks/decode_profile.py [--preset llama-3.2-1b | --model DIR] [--context 256]
                                        [--batch 1 8 64 256] [--compare-fuse] [--compare-prefetch [MB ...]]
                                        [--compare-early-kv] [--compare-gemv] [--leave-one-out]

"weights TB/s" is weight bytes over the graph's GPU time. Prints two tables; run on a GPU machine (the model is written to /tmp if absent).
--compare-fuse adds, at the smallest batch, the graph time with TINYVLLM_FUSE=0's nine launches
per layer and with the fused decode layer at each TINYVLLM_FUSE_NORM (none: seven, all: five,
auto: the default rule, producer: five, the norms handed over), and the per-op tables of the
nine, of the default and of producer, each op also per
layer (decode graphs recaptured for each setting).
--compare-prefetch adds, at the smallest batch, the graph time with the decode attention's L2
prefetch of the next weights (gpu/model.py) at each budget in MB per layer (default: 0 = off, the
engine's default, and model.L2_PREFETCH_BYTES, what TINYVLLM_L2_PREFETCH=1 turns on). Judge it by the graph times: the per-op
tables replay each op alone, where the attention carries the prefetch traffic and no GEMV after
it can profit.
--compare-early-kv adds, at the smallest batch, the graph time with the decode attention's early
K/V copies (TINYVLLM_ATTN_EARLY_KV, attention_decode.cu) off and on, twice each, alternating (the
spread of the repeats is the noise to judge the difference by).
--compare-gemv adds, at the smallest batch, the graph time under each GEMV setting of
gemv_configs() (the LM head on the GEMV or cuBLAS, the .L2::256B hint off or everywhere, the wave
the per-layer GEMVs fill), two rounds alternating.
--leave-one-out adds, at the smallest batch, each op's in-graph cost: the decode graph's GPU time
less that of the graph captured without the op (ops.skip_ops). The per-op tables cannot show
what PDL hides: an op that runs under its neighbour's weight stream costs little here.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.gpu.ops import FUSE_NORM_DEFAULT


def decode_batch(num_seqs: int, context: int, block_size: int, rng) -> ForwardBatch:
    blocks = -(-context // block_size)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(num_seqs)]
    tokens = [[int(t)] for t in rng.integers(0, 1000, num_seqs)]
    return ForwardBatch.build(tokens, [context] * num_seqs, tables, block_size, is_prefill=False)


def time_steps(runner, batch, replay: bool, repeats: int = 30) -> float:
    sampling = SamplingBatch.greedy(batch.num_seqs)
    for _ in range(3):
        runner.execute(batch, sampling, replay=replay)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(batch, sampling, replay=replay)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def graph_gpu_time(runner, batch, repeats: int = 50) -> float:
    """GPU time of one decode graph replay alone (CUDA events around back-to-back launches, the
    two input banks' graphs in turn): the step time minus this is the host's share."""
    import pycuda.driver as drv
    size = runner._graph_size_for(batch.num_seqs)
    with runner.device.active():
        graphs = [runner.graphs[size, runner._stage_inputs(batch, SamplingBatch.greedy(batch.num_seqs), rows=size).bank]
                  for _ in range(2)]
        graphs[0].launch(runner.stream)
        start, end = drv.Event(), drv.Event()
        start.record(runner.stream)
        for i in range(repeats):
            graphs[i % 2].launch(runner.stream)
        end.record(runner.stream)
        end.synchronize()
        return end.time_since(start) / 1e3 / repeats


def step_copies(runner, batch, repeats: int = 50) -> None:
    """GPU time per step of back-to-back decode-graph replays (their sampler writes the ids to
    the host itself), alone and as the engine enqueues them (cuda_runner.launch: the inputs staged
    and uploaded into the step's bank on the copy stream, which the stream waits for, the graph,
    the event the host waits on); and, for comparison, with the upload on the stream itself
    between the graphs (the road before session 17): what the stream spends besides the graphs."""
    import pycuda.driver as drv
    S, size = batch.num_seqs, runner._graph_size_for(batch.num_seqs)
    sampling = SamplingBatch.greedy(S)
    nbytes = runner._block_tables_offset + size * batch.block_tables.shape[1] * 4

    def graph_alone(i):
        runner.graphs[size, i % 2].launch(runner.stream)

    def engine_step(i):
        step = runner._stage_inputs(batch, sampling, rows=size)
        runner.graphs[size, step.bank].launch(runner.stream)
        done.record(runner.stream)

    def upload_on_stream(i):
        runner.arena.upload_inputs(nbytes, i % 2, runner.stream)
        runner.graphs[size, i % 2].launch(runner.stream)
        done.record(runner.stream)

    rows = []
    with runner.device.active():
        done = drv.Event()
        for _ in range(2):
            runner._stage_inputs(batch, sampling, rows=size)      # both banks hold this batch
        for name, enqueue in (("graph alone", graph_alone), ("the engine's step", engine_step),
                              ("the upload on the stream + graph + event", upload_on_stream),
                              ("graph alone (again)", graph_alone)):
            runner.stream.synchronize()
            enqueue(0)
            start, end = drv.Event(), drv.Event()
            start.record(runner.stream)
            for i in range(repeats):
                enqueue(i)
            end.record(runner.stream)
            end.synchronize()
            rows.append((name, end.time_since(start) / repeats))
    print(f"\nthe step's transfers on the stream, batch {S} (GPU ms per step, {repeats} back to back):")
    for name, ms in rows:
        print(f"{name:<56} {ms:8.3f}  ({(ms - rows[0][1]) * 1e3:+6.1f} us)")


def per_op_times(runner, batch, repeats: int = 20) -> dict[str, float]:
    """GPU microseconds per op name in one decode step, inside CUDA graphs: record every launch
    of an eager step, then capture all launches of each op (×repeats) into a graph of its own and
    time its replays with CUDA events. Launch gaps are excluded, as in the real decode graph."""
    import pycuda.driver as drv

    from tinyvllm.gpu.graphs import CudaGraph
    calls: dict[str, list] = defaultdict(list)
    runner.ops.observer = lambda op, repeat, details: calls[op].append(repeat)
    try:
        runner.execute(batch, SamplingBatch.greedy(batch.num_seqs), replay=False)
    finally:
        runner.ops.observer = None
    times = {}
    with runner.device.active():
        for name, launches in calls.items():
            with CudaGraph.capture(runner.stream) as graph:
                for _ in range(repeats):
                    for launch in launches:
                        launch()
            graph.launch(runner.stream)
            start, end = drv.Event(), drv.Event()
            start.record(runner.stream)
            graph.launch(runner.stream)
            end.record(runner.stream)
            end.synchronize()
            times[f"{name} (x{len(launches)})"] = end.time_since(start) * 1e3 / repeats
            graph.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--model", default=None, help="a model directory instead of --preset's random weights "
                                                  "(e.g. the converted SmolLM2-135M-Instruct)")
    ap.add_argument("--compare-fuse", action="store_true",
                    help="time the smallest batch with the fused decode layer and without (TINYVLLM_FUSE=0)")
    ap.add_argument("--compare-prefetch", type=float, nargs="*", metavar="MB",
                    help="time the smallest batch with these L2 prefetch budgets per layer (0: off)")
    ap.add_argument("--compare-early-kv", action="store_true",
                    help="time the smallest batch with the decode attention's early K/V copies off and on")
    ap.add_argument("--step-copies", action="store_true",
                    help="GPU time per step of the decode graphs alone, as the engine enqueues them (the "
                         "inputs' upload on the copy stream), and with the upload between the graphs")
    ap.add_argument("--compare-gemv", action="store_true",
                    help="time the smallest batch under each GEMV setting (gemv_configs())")
    ap.add_argument("--k-warps", nargs="+", default=[], metavar="SPEC",
                    help="with --compare-gemv, also these per-projection k-splits, each as TINYVLLM_GEMV_K_WARPS "
                         "takes them (e.g. qkv=8 gate_up=8,down=16)")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="each op's in-graph cost at the smallest batch: the graph without it")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--prefill", type=int, nargs=2, default=[16, 512], metavar=("PROMPTS", "LEN"))
    args = ap.parse_args()
    from tinyvllm.gpu.ops import parse_k_warps_for
    try:
        k_warps_specs = [(spec, parse_k_warps_for(spec)) for spec in args.k_warps]
    except ValueError as e:
        ap.error(str(e))
    from tinyvllm.checkpoint.model_writer import write_model
    from tinyvllm.gpu.cuda_runner import CudaRunner
    path = Path(args.model) if args.model else Path(f"/tmp/tinyvllm-models/{args.preset}")
    if not args.model and not (path / "config.json").exists():
        write_model(path, preset=args.preset)
    cfg = ModelConfig.from_pretrained(path)
    runner = CudaRunner(cfg, load_weights(path, cfg),
                        EngineConfig(max_num_seqs=max(max(args.batch), args.prefill[0]), max_num_batched_tokens=args.prefill[0] * args.prefill[1],
                                     max_model_len=4096, kv_cache_gb=max(max(args.batch) * args.context, args.prefill[0] * args.prefill[1])
                                     * cfg.kv_bytes_per_token / 2**30 * 1.1 + 0.1))
    print(runner.memory_report())
    rng = np.random.default_rng(0)
    weight_gb = cfg.num_parameters * 2 / 1e9
    print(f"\n{args.model or args.preset}: {weight_gb:.2f} GB of weights, context {args.context}")
    print(f"{'batch':>6} {'eager ms':>10} {'graph ms':>10} {'graph GPU ms':>13} {'graph tok/s':>12} {'weights TB/s':>13}")
    profile_batch = None
    for s in args.batch:
        batch = decode_batch(s, args.context, runner.engine_cfg.block_size, rng)
        eager, graph = time_steps(runner, batch, replay=False), time_steps(runner, batch, replay=True)
        gpu = graph_gpu_time(runner, batch)
        print(f"{s:>6} {eager * 1e3:>10.3f} {graph * 1e3:>10.3f} {gpu * 1e3:>13.3f} {s / graph:>12,.0f} "
              f"{weight_gb / gpu / 1e3:>13.2f}")
        profile_batch = profile_batch or batch
    print_ops(per_op_times(runner, profile_batch), f"one decode step, batch {profile_batch.num_seqs}")
    if args.compare_fuse:
        compare_fuse(runner, profile_batch, cfg.num_hidden_layers)
    if args.compare_prefetch is not None:
        compare_prefetch(runner, profile_batch, args.compare_prefetch)
    if args.compare_early_kv:
        compare_early_kv(runner, profile_batch)
    if args.step_copies:
        step_copies(runner, profile_batch)
    if args.compare_gemv:
        compare_gemv(runner, profile_batch, cfg, k_warps_specs)
    if args.leave_one_out:
        leave_one_out(runner, profile_batch)
    big = decode_batch(max(args.batch), args.context, runner.engine_cfg.block_size, rng)
    print_ops(per_op_times(runner, big), f"one decode step, batch {big.num_seqs}")
    prompts, plen = args.prefill
    prefill = prefill_batch(prompts, plen, runner.engine_cfg.block_size, rng)
    t = time_prefill(runner, prefill)
    print(f"\nprefill {prompts} x {plen} tokens: {t * 1e3:.2f} ms wall ({prompts * plen / t:,.0f} tok/s)")
    print_ops(per_op_times(runner, prefill), f"one prefill step, {prompts} x {plen} tokens")
    runner.close()


def prefill_batch(num_prompts: int, length: int, block_size: int, rng) -> ForwardBatch:
    blocks = -(-length // block_size)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(num_prompts)]
    prompts = [[int(t) for t in rng.integers(0, 1000, length)] for _ in range(num_prompts)]
    return ForwardBatch.build(prompts, [length] * num_prompts, tables, block_size, is_prefill=True)


def time_prefill(runner, batch, repeats: int = 5) -> float:
    sampling = SamplingBatch.greedy(batch.num_seqs)
    runner.execute(batch, sampling)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(batch, sampling)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# (label, ops.fuse, ops.fuse_norm); the fused row at ops' own default is marked, and gets a per-op table
FUSE_CONFIGS = [("TINYVLLM_FUSE=0", False, FUSE_NORM_DEFAULT)] + [
    (f"fused, TINYVLLM_FUSE_NORM={norm}{' (default)' if norm == FUSE_NORM_DEFAULT else ''}", True, norm)
    for norm in ("none", "all", "auto", "producer")]


def graph_times(runner, batch) -> tuple[float, float]:
    """(wall s, GPU s) of one decode-graph replay under the graphs as now captured."""
    return time_steps(runner, batch, replay=True), graph_gpu_time(runner, batch)


def print_graph_rows(title: str, label: str, rows, num_seqs: int, extra: str = "") -> None:
    """The --compare-* tables: rows of (setting, wall s, GPU s[, extra column])."""
    width = max(len(label), *(len(r[0]) for r in rows))
    print(f"\n{title}:")
    print(f"{label:<{width}} {'graph ms':>9} {'graph GPU ms':>13} {'tok/s':>8}" + (f"  {extra}" if extra else ""))
    for name, graph, gpu, *more in rows:
        print(f"{name:<{width}} {graph * 1e3:>9.3f} {gpu * 1e3:>13.3f} {num_seqs / graph:>8,.0f}"
              + "".join(f"  {m}" for m in more))


def compare_fuse(runner, batch, num_layers: int) -> None:
    """Graph time and GPU time of one decode step for each fusion setting (runner.ops.fuse and
    fuse_norm, as TINYVLLM_FUSE / TINYVLLM_FUSE_NORM set them), and the per-op tables of the
    nine-launch layer and of the default."""
    rows, tables = [], {}
    for name, fuse, fuse_norm in FUSE_CONFIGS:
        with runner.recaptured(fuse=fuse, fuse_norm=fuse_norm):
            rows.append((name, *graph_times(runner, batch)))
            if not fuse or fuse_norm in (FUSE_NORM_DEFAULT, "producer"):
                tables[name] = per_op_times(runner, batch)
    print_graph_rows(f"fusion at batch {batch.num_seqs}", "setting", rows, batch.num_seqs)
    for name, ops in tables.items():
        print_ops(ops, f"one decode step, batch {batch.num_seqs}, {name}", per_layer=num_layers)


def compare_prefetch(runner, batch, budgets_mb: list[float]) -> None:
    """Graph time and GPU time of one decode step for each L2 prefetch budget per layer
    (runner.model.l2_prefetch_bytes; 0 launches no prefetch blocks, the engine's default)."""
    from tinyvllm.gpu.model import L2_PREFETCH_BYTES
    budgets = budgets_mb or [0, L2_PREFETCH_BYTES / 2**20]
    was, rows = runner.model.l2_prefetch_bytes, []
    try:
        for mb in budgets:
            runner.model.l2_prefetch_bytes = int(mb * 2**20) // 16 * 16
            with runner.recaptured(l2_prefetch=mb > 0):
                label = "off (default)" if mb <= 0 else f"{mb:g}" + (
                    " (TINYVLLM_L2_PREFETCH=1)" if int(mb * 2**20) == L2_PREFETCH_BYTES else "")
                rows.append((label, *graph_times(runner, batch)))
    finally:
        runner.model.l2_prefetch_bytes = was
        runner.recapture_decode_graphs()
    print_graph_rows(f"L2 prefetch of the next weights by the decode attention, batch {batch.num_seqs}",
                     "MB per layer", rows, batch.num_seqs)


def compare_early_kv(runner, batch) -> None:
    """Graph time and GPU time of one decode step with runner.ops.early_kv off and on (decode
    graphs recaptured for each), off/on/off/on."""
    rows = []
    for on in (False, True, False, True):
        with runner.recaptured(early_kv=on):
            rows.append(("on (default)" if on else "off (TINYVLLM_ATTN_EARLY_KV=0)", *graph_times(runner, batch)))
    print_graph_rows(f"early K/V copies in the decode attention, batch {batch.num_seqs}", "early_kv",
                     rows, batch.num_seqs)


# gemv_configs(): (label, GpuOps settings). The LM head on the GEMV (gemv_k_warps' `last` rule)
# or on cuBLAS; the ring path (gemv_ring: weights through cp.async rings in shared memory) in a
# wave of 16 warps/SM, where the next kernel's CTAs have room beside this one's; the register
# path. Sessions 8 and 9 also timed the .L2::256B hint by rule and everywhere, waves of 24, grids
# past one wave and CTAs of at most 16 warps (docs/perf-notes.md).
def gemv_configs(vocab_size: int, k_warps_specs=()) -> list[tuple[str, dict]]:
    """The settings --compare-gemv times; k_warps_specs: [(label, {projection: warps})] added."""
    return [("default (ring path, wave 32, o capped at 16, hint on)", {}),
            *[(f"k-split {label}", {"gemv_k_warps_for": table}) for label, table in k_warps_specs],
            ("LM head on cuBLAS", {"gemv_max_n": vocab_size - 1}),
            ("ring path, wave 16", {"gemv_wave_warps": 16}),
            ("o at 32 warps (no room beside the attention)", {"gemv_k_warps_for": {"o": 32}}),
            ("down at 16 warps", {"gemv_k_warps_for": {"down": 16}}),
            ("registers (TINYVLLM_GEMV_RING=0)", {"gemv_ring": False})]


def compare_gemv(runner, batch, cfg, k_warps_specs=()) -> None:
    """Graph time and GPU time of one decode step under each gemv_configs() setting, two rounds
    alternating, with each setting's k-split warps per projection."""
    shapes = {**runner.model.projection_shapes, "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    ops, rows = runner.ops, []
    for _ in range(2):
        for name, settings in gemv_configs(cfg.vocab_size, k_warps_specs):
            with runner.recaptured(**settings):
                warps = " ".join(f"{s}:{ops.gemv_k_warps(n, k, last=True) if s == 'lm_head' else ops.decode_k_warps(s, n, k)}"
                                 if ops.on_gemv(batch.num_seqs, n, k) else f"{s}:cuBLAS" for s, (n, k) in shapes.items())
                rows.append((name, *graph_times(runner, batch), warps))
    print_graph_rows(f"GEMV settings, batch {batch.num_seqs}", "setting", rows, batch.num_seqs, "k-split warps")


def leave_one_out(runner, batch) -> None:
    """Each op's in-graph cost: the decode graph's GPU time with all of that op's launches left
    out (ops.skip_ops), against the whole graph's. Unlike the per-op tables, where each op is
    replayed alone, this counts what an op costs where it runs, with its neighbours and PDL: an
    op hidden under the next one's weight stream costs little here. The step computes garbage
    meanwhile, which changes no kernel's time (none branches on the values at greedy decode)."""
    launches: dict[str, int] = defaultdict(int)
    runner.ops.observer = lambda op, repeat, details: launches.__setitem__(op, launches[op] + 1)
    try:
        runner.execute(batch, SamplingBatch.greedy(batch.num_seqs), replay=False)
    finally:
        runner.ops.observer = None
    whole = graph_gpu_time(runner, batch)
    rows = []
    for name, count in launches.items():
        with runner.recaptured(skip_ops=frozenset({name})):
            rows.append((name, count, whole - graph_gpu_time(runner, batch)))
    print(f"\nin-graph cost per op, batch {batch.num_seqs}: graph GPU time {whole * 1e6:.1f} us, and without each op:")
    print(f"{'op (launches per step)':<34} {'us/step':>9} {'us/launch':>10} {'share':>7}")
    for name, count, saved in sorted(rows, key=lambda r: -r[2]):
        print(f"{f'{name} (x{count})':<34} {saved * 1e6:>9.1f} {saved * 1e6 / count:>10.2f} {saved / whole:>7.1%}")
    print(f"{'sum (overlap makes it differ from the whole)':<44} {sum(r[2] for r in rows) * 1e6:>9.1f}")


def print_ops(ops: dict[str, float], what: str, per_layer: int = 0) -> None:
    total = sum(ops.values())
    print(f"\nGPU time per op in {what}, each op's launches replayed in a CUDA graph of their own:")
    layer_head = f" {'us/layer':>9}" if per_layer else ""
    print(f"{'op (launches per step)':<34} {'us/step':>9} {'us/launch':>10} {'share':>7}{layer_head}")
    for name, us in sorted(ops.items(), key=lambda kv: -kv[1]):
        n = int(name.rsplit("(x", 1)[1].rstrip(")"))
        layer = f" {us / per_layer:>9.2f}" if per_layer else ""
        print(f"{name:<34} {us:>9.1f} {us / n:>10.2f} {us / total:>7.1%}{layer}")
    print(f"{'sum':<34} {total:>9.1f}" + (f" {'':>10} {'':>7} {total / per_layer:>9.2f}" if per_layer else ""))


if __name__ == "__main__":
    main()
