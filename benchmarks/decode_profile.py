"""Where a decode step's time goes, on the GPU: whole-step wall time for eager launches vs
CUDA-graph replay at several batch sizes, the GPU time of a replay alone, and per-op GPU time
(each op's launches of one step captured into a graph of their own and timed with CUDA events).

    python benchmarks/decode_profile.py [--preset llama-3.2-1b | --model DIR] [--context 256]
                                        [--batch 1 8 64 256] [--compare-fuse] [--compare-pdl]
                                        [--step-copies] [--leave-one-out]
                                        [--mixed ROWS CONTEXT CHUNK PROMPT_LEN]

"weights TB/s" is weight bytes over the graph's GPU time. Prints two tables; run on a GPU machine (the model is written to /tmp if absent).
--compare-fuse adds, at the smallest batch, the graph time of the fused decode layer (the
default: five launches a layer) and of the nine-launch layer (EngineConfig.fused_decode=False),
twice each, alternating, and the per-op tables of both, each op also per layer (decode graphs
recaptured for each setting).
--compare-pdl adds, at the smallest batch, the graph time with programmatic dependent launch (the
default) and without it (EngineConfig.pdl=False), twice each, alternating.
--step-copies adds the GPU time per step of the decode graphs alone, as the engine enqueues them,
and with the inputs' upload on the stream between the graphs.
--leave-one-out adds, at the smallest batch, each op's in-graph cost: the decode graph's GPU time
less that of the graph captured without the op (ops.skip_ops). The per-op tables cannot show
what PDL hides: an op that runs under its neighbour's weight stream costs little here.
--mixed ROWS CONTEXT CHUNK PROMPT_LEN (e.g. 64 3000 1984 4096) adds, after the other tables, a
mixed step as engine/scheduler.py builds it (mixed_step below): ROWS decode rows (one new token
each at context CONTEXT, their own KV blocks) first, then one chunk of CHUNK new tokens of a
PROMPT_LEN-token prompt whose first PROMPT_LEN - CHUNK tokens are cached (the chunk's attention
reads them through its block table); one prefill-kind forward, eager (no graph). The scheduler
fills a budget of B tokens so: CHUNK = B - ROWS. It prints the wall time (median, as
time_prefill) of the mixed step, of the decode rows alone as a decode step (eager, graph replay
and the graph's GPU time: the --batch path) and of the chunk alone as a prefill step; the host
time of ForwardBatch.build for the mixed step and, for the two eager prefill-kind steps, of
staging their inputs (runner._stage_inputs), of enqueueing the forward's launches
(model.forward returns once they are enqueued), and the stream's time for that forward (CUDA
events around it: near the per-op sum where the GPU is the bottleneck, near the enqueue time
where the host's launches are); then the per-op tables of the three. Add --batch ROWS to
keep the rest of the run short.
--shared-prefix N adds, for each --batch size, the graph GPU time of the same decode step whose
sequences share the physical KV blocks of their first N tokens (what the prefix cache makes of a
common system prompt: bench's prefix workload shares 1,024), and the per-op table of the largest.
Where the batch qualifies for cascade attention (at least 8 rows and 256 shared tokens: engine/
batch.py) the shared step runs it (attention_decode from the prefix's end, then
attention_cascade_prefix): the table shows both, and the ratio what cascade gains over private
blocks whose prefix reads the L2 partly serves.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch


def decode_batch(num_seqs: int, context: int, block_size: int, rng, shared_tokens: int = 0) -> ForwardBatch:
    """num_seqs decode rows at context `context`, each with its own KV blocks but for the first
    shared_tokens // block_size, which are the same physical blocks in every table (a prompt
    prefix the prefix cache shares, as in bench's prefix workload)."""
    blocks = -(-context // block_size)
    shared = min(shared_tokens // block_size, blocks)
    own = blocks - shared
    tables = [list(range(shared)) + list(range(shared + i * own, shared + (i + 1) * own)) for i in range(num_seqs)]
    tokens = [[int(t)] for t in rng.integers(0, 1000, num_seqs)]
    return ForwardBatch.build(tokens, [context] * num_seqs, tables, block_size, is_prefill=False)


class MixedStep(NamedTuple):
    """A mixed step and its two parts, sharing tokens and KV blocks (mixed_step)."""
    mixed: ForwardBatch       # the decode rows, then the prompt chunk: one prefill-kind batch
    decode: ForwardBatch      # the decode rows alone: a decode batch (decode_batch's)
    chunk: ForwardBatch       # the prompt chunk alone: a prefill batch of one sequence
    build_args: tuple         # ForwardBatch.build's (new_tokens, context_lens, block_tables) of `mixed`

    @property
    def num_blocks(self) -> int:
        """KV blocks the cache must hold: the rows' tables are disjoint and start at block 0."""
        return int(self.mixed.block_tables.max()) + 1


def mixed_step(rows: int, context: int, chunk: int, prompt_len: int, block_size: int, rng) -> MixedStep:
    """The step engine/scheduler.py schedules for `rows` running sequences at context `context`
    (each with blocks for its whole context, try_append_slot) and one waiting prompt of
    prompt_len tokens of which the first prompt_len - chunk are cached, the chunk ending it
    (block_manager.allocate gave it blocks for the whole prompt): decode rows first, then the
    prompt's chunk, built as ScheduledBatch.forward_batch builds a prefill-kind step, each row's
    new tokens at the end of its context (a decode row: context_len = context, its one token at
    position context - 1). Pure numpy: tests/test_decode_profile_mixed.py checks it and runs it
    on the numpy backend. The decode rows are decode_batch's (same tokens and tables); the
    prompt's blocks follow theirs."""
    if rows < 1 or context < 1 or not 1 <= chunk <= prompt_len:
        raise ValueError(f"--mixed needs ROWS >= 1, CONTEXT >= 1 and 1 <= CHUNK <= PROMPT_LEN, got "
                         f"{rows} {context} {chunk} {prompt_len}")
    decode = decode_batch(rows, context, block_size, rng)
    first = int(decode.block_tables.max()) + 1
    table = list(range(first, first + -(-prompt_len // block_size)))
    chunk_tokens = [int(t) for t in rng.integers(0, 1000, chunk)]
    args = ([[t] for t in decode.token_ids.tolist()] + [chunk_tokens], decode.context_lens.tolist() + [prompt_len],
            decode.block_tables.tolist() + [table])
    return MixedStep(mixed=ForwardBatch.build(*args, block_size, is_prefill=True), decode=decode,
                     chunk=ForwardBatch.build([chunk_tokens], [prompt_len], [table], block_size, is_prefill=True),
                     build_args=args)


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
    between the graphs (gpu/input_banks.py says why it is not): what the stream spends besides
    the graphs."""
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
                    help="time the smallest batch with the fused decode layer and with the nine-launch one")
    ap.add_argument("--compare-pdl", action="store_true",
                    help="time the smallest batch with programmatic dependent launch and without")
    ap.add_argument("--step-copies", action="store_true",
                    help="GPU time per step of the decode graphs alone, as the engine enqueues them (the "
                         "inputs' upload on the copy stream), and with the upload between the graphs")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="each op's in-graph cost at the smallest batch: the graph without it")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--prefill", type=int, nargs=2, default=[16, 512], metavar=("PROMPTS", "LEN"))
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="also time the decode steps with the first N context tokens in blocks shared by all rows")
    ap.add_argument("--mixed", type=int, nargs=4, default=None, metavar=("ROWS", "CONTEXT", "CHUNK", "PROMPT_LEN"),
                    help="also profile a mixed step: ROWS decode rows at CONTEXT beside a CHUNK-token chunk "
                         "ending a PROMPT_LEN-token prompt (its start cached), and its two parts alone")
    args = ap.parse_args()
    block_size = EngineConfig().block_size
    mixed = None
    if args.mixed:
        try:
            mixed = mixed_step(*args.mixed, block_size, np.random.default_rng(1))
        except ValueError as e:
            ap.error(str(e))
    from tinyvllm.checkpoint.model_writer import write_model
    from tinyvllm.gpu.cuda_runner import CudaRunner
    path = Path(args.model) if args.model else Path(f"/tmp/tinyvllm-models/{args.preset}")
    if not args.model and not (path / "config.json").exists():
        write_model(path, preset=args.preset)
    cfg = ModelConfig.from_pretrained(path)
    # room for the decode batches, the prefill and the mixed step (ROWS + 1 sequences, ROWS + CHUNK
    # tokens, the blocks of mixed_step's tables, contexts up to PROMPT_LEN)
    seqs, tokens = max(max(args.batch), args.prefill[0]), args.prefill[0] * args.prefill[1]
    cache_tokens, model_len = max(max(args.batch) * args.context, tokens), max(4096, args.context)
    if mixed is not None:
        seqs, tokens = max(seqs, mixed.mixed.num_seqs), max(tokens, mixed.mixed.num_tokens)
        cache_tokens = max(cache_tokens, mixed.num_blocks * block_size)
        model_len = max(model_len, int(mixed.mixed.context_lens.max()))
    runner = CudaRunner(cfg, load_weights(path, cfg),
                        EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, block_size=block_size,
                                     max_model_len=model_len,
                                     kv_cache_gb=cache_tokens * cfg.kv_bytes_per_token / 2**30 * 1.1 + 0.1))
    if mixed is not None and runner.num_kv_blocks < mixed.num_blocks:
        raise SystemExit(f"the KV cache holds {runner.num_kv_blocks} blocks, the mixed step needs {mixed.num_blocks}")
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
    if args.compare_pdl:
        compare_pdl(runner, profile_batch)
    if args.step_copies:
        step_copies(runner, profile_batch)
    if args.leave_one_out:
        leave_one_out(runner, profile_batch)
    big = decode_batch(max(args.batch), args.context, runner.engine_cfg.block_size, rng)
    print_ops(per_op_times(runner, big), f"one decode step, batch {big.num_seqs}")
    if args.shared_prefix:
        shared_prefix(runner, args.batch, args.context, args.shared_prefix, rng)
    prompts, plen = args.prefill
    prefill = prefill_batch(prompts, plen, runner.engine_cfg.block_size, rng)
    t = time_prefill(runner, prefill)
    print(f"\nprefill {prompts} x {plen} tokens: {t * 1e3:.2f} ms wall ({prompts * plen / t:,.0f} tok/s)")
    print_ops(per_op_times(runner, prefill), f"one prefill step, {prompts} x {plen} tokens")
    if mixed is not None:
        profile_mixed(runner, mixed)
    runner.close()


def shared_prefix(runner, batch_sizes, context: int, shared_tokens: int, rng) -> None:
    """--shared-prefix: each batch size's decode graph GPU time with private blocks and with the
    first shared_tokens tokens in blocks common to every row, then the per-op table of the largest."""
    block_size = runner.engine_cfg.block_size
    print(f"\ndecode steps at context {context}, the first {shared_tokens} tokens private or shared by every row:")
    print(f"{'batch':>6} {'private GPU ms':>15} {'shared GPU ms':>14} {'shared / private':>17}")
    for s in batch_sizes:
        private = graph_gpu_time(runner, decode_batch(s, context, block_size, rng))
        shared = graph_gpu_time(runner, decode_batch(s, context, block_size, rng, shared_tokens))
        print(f"{s:>6} {private * 1e3:>15.3f} {shared * 1e3:>14.3f} {shared / private:>17.3f}")
    big = decode_batch(max(batch_sizes), context, block_size, rng, shared_tokens)
    print_ops(per_op_times(runner, big), f"one decode step, batch {big.num_seqs}, {shared_tokens} tokens shared")


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


def forward_host_times(runner, batch, repeats: int = 5) -> tuple[float, float, float]:
    """(staging s, enqueue s, stream s), medians, of an eager forward as execute() runs it, the
    stream idle before each: runner._stage_inputs (the inputs written into the page-locked
    mirror, their upload enqueued on the copy stream), model.forward (returns once its launches
    are enqueued: the host's launch time), and the stream's time from the start of that
    forward to its end (CUDA events around it: the GPU's time where the GPU is the bottleneck,
    the host's launch time where the host is). Sampling and the ids' copy back are left out."""
    import pycuda.driver as drv
    stage, enqueue, stream = [], [], []
    sampling = SamplingBatch.greedy(batch.num_seqs)
    with runner.device.active():
        for i in range(repeats + 1):                 # the first: warm-up
            runner.stream.synchronize()
            t0 = time.perf_counter()
            step = runner._stage_inputs(batch, sampling)
            t1 = time.perf_counter()
            start, end = drv.Event(), drv.Event()
            start.record(runner.stream)
            t2 = time.perf_counter()
            runner.model.forward(step)
            t3 = time.perf_counter()
            end.record(runner.stream)
            end.synchronize()
            if i:
                stage.append(t1 - t0)
                enqueue.append(t3 - t2)
                stream.append(end.time_since(start) / 1e3)
    return float(np.median(stage)), float(np.median(enqueue)), float(np.median(stream))


def profile_mixed(runner, step: MixedStep) -> None:
    """--mixed: wall times of the mixed step and of its parts alone, host times, and the per-op
    tables of the three (module docstring)."""
    mixed, decode, chunk = step.mixed, step.decode, step.chunk
    rows, context = decode.num_seqs, int(decode.context_lens[0])
    prompt_len = int(chunk.context_lens[0])
    what = (f"{rows} decode rows at context {context} + a chunk of {chunk.num_tokens} tokens ending a "
            f"{prompt_len}-token prompt ({prompt_len - chunk.num_tokens} cached)")
    print(f"\nmixed step: {what}; {mixed.num_tokens} tokens, {mixed.num_seqs} sequences, one prefill-kind "
          f"forward (eager)")
    t_mixed, t_chunk = time_prefill(runner, mixed), time_prefill(runner, chunk)
    eager = time_steps(runner, decode, replay=False)
    graph, graph_gpu = graph_times(runner, decode)
    print(f"{'step':<52} {'wall ms':>9}")
    print(f"{'mixed (eager, prefill-kind)':<52} {t_mixed * 1e3:>9.2f}")
    print(f"{f'decode rows alone, batch {rows}: graph replay':<52} {graph * 1e3:>9.2f}  "
          f"(graph GPU {graph_gpu * 1e3:.2f} ms; eager {eager * 1e3:.2f} ms)")
    print(f"{f'chunk alone, 1 x {chunk.num_tokens} tokens (eager, prefill)':<52} {t_chunk * 1e3:>9.2f}")
    print(f"{'decode graph + chunk alone':<52} {(graph + t_chunk) * 1e3:>9.2f}  "
          f"(mixed - that: {(t_mixed - graph - t_chunk) * 1e3:+.2f} ms)")
    build = []
    for _ in range(5):
        t0 = time.perf_counter()
        ForwardBatch.build(*step.build_args, runner.engine_cfg.block_size, is_prefill=True)
        build.append(time.perf_counter() - t0)
    print(f"\nhost: ForwardBatch.build of the mixed step {np.median(build) * 1e3:.3f} ms (the scheduler's "
          f"forward_batch also slices each sequence's new tokens)")
    print(f"{'eager forward (medians)':<40} {'stage ms':>9} {'enqueue ms':>11} {'stream ms':>10}")
    for name, batch in (("mixed", mixed), ("chunk alone", chunk)):
        stage, enqueue, stream = forward_host_times(runner, batch)
        print(f"{name:<40} {stage * 1e3:>9.3f} {enqueue * 1e3:>11.3f} {stream * 1e3:>10.3f}")
    print_ops(per_op_times(runner, mixed), f"the mixed step ({what})")
    print_ops(per_op_times(runner, decode), f"the decode rows alone (one decode step, batch {rows} at context {context})")
    print_ops(per_op_times(runner, chunk), f"the chunk alone (one prefill step, {chunk.num_tokens} tokens after "
                                          f"{prompt_len - chunk.num_tokens} cached)")


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
    """Graph time and GPU time of one decode step on the fused decode layer and on the
    nine-launch one (runner.ops.fused_decode, as EngineConfig.fused_decode sets it), alternating,
    and the per-op tables of both."""
    rows, tables = [], {}
    for fused in (True, False, True, False):
        name = "fused (default)" if fused else "nine launches (fused_decode=False)"
        with runner.recaptured(fused_decode=fused):
            rows.append((name, *graph_times(runner, batch)))
            if name not in tables:
                tables[name] = per_op_times(runner, batch)
    print_graph_rows(f"fusion at batch {batch.num_seqs}", "layer", rows, batch.num_seqs)
    for name, ops in tables.items():
        print_ops(ops, f"one decode step, batch {batch.num_seqs}, {name}", per_layer=num_layers)


def compare_pdl(runner, batch) -> None:
    """Graph time and GPU time of one decode step with programmatic dependent launch and without
    (runner.ops.pdl, as EngineConfig.pdl sets it), alternating."""
    rows = []
    for pdl in (True, False, True, False):
        with runner.recaptured(pdl=pdl):
            rows.append(("on (default)" if pdl else "off (pdl=False)", *graph_times(runner, batch)))
    print_graph_rows(f"programmatic dependent launch, batch {batch.num_seqs}", "pdl", rows, batch.num_seqs)


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
