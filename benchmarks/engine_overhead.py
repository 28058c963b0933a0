"""The engine's own host time per step, with the model taken out.

The real LLMEngine, Scheduler, BlockManager, tokenizer and detokenizer run; the ModelRunner is
replaced by InstantRunner, which answers at once with a deterministic token per sequence (a hash
of its last token and position, never an EOS or special token). What remains of a step's wall
time is exactly the Python the engine adds around a GPU step: scheduling, building the batch,
postprocessing, detokenizing, RequestOutputs, and what the consumer reads from them.

    python benchmarks/engine_overhead.py                       # every workload, both consumers
    python benchmarks/engine_overhead.py --workload batch256 --consumer stream --profile
    python benchmarks/engine_overhead.py --stats      # with the server's per-step StepStats on

Workloads (prompt ids < 10,000 as in `tinyvllm bench`, greedy, ignore_eos):
  latency     1 request, 128-token prompt, 256 output tokens
  batch64     64 x (128 in, 128 out)
  batch256    256 x (128 in, 128 out): a steady 256-sequence decode
  throughput  256 requests, prompt and output lengths U[100, 1024], seed 0 (--scale shrinks
              the output lengths)
Consumers:
  offline     what LLM.generate reads: `finished` of every output, `text` of the final ones
              (that last read is timed separately: "final text ms")
  stream      what the server reads of every output: delta_text, token counts, finish reason
The model is the `tiny` preset written by tinyvllm.model_writer (real Llama 3 tokenizer, vocab
128,256), kept in /tmp/tinyvllm-models/tiny. Host time excludes InstantRunner's own time.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's tinyvllm
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.sampling_params import SamplingParams

MODEL_DIR = Path("/tmp/tinyvllm-models/tiny")
PROMPT_TOKEN_ID_LIMIT = 10_000
OUTPUT_TOKEN_IDS = (1_000, 100_000)      # ordinary (non-special) Llama 3 tokens: never EOS

WORKLOADS = {      # name: (requests, prompt length range, output length range), inclusive
    "latency": (1, (128, 128), (256, 256)),
    "batch64": (64, (128, 128), (128, 128)),
    "batch256": (256, (128, 128), (128, 128)),
    "throughput": (256, (100, 1024), (100, 1024)),
}


class InstantRunner(ModelRunner):
    """A ModelRunner with no model: the next token of each sequence is a hash of its last new
    token and that token's position. Records the kind and size of the last batch and the time
    it spent itself (subtracted from the engine's)."""

    def __init__(self, num_kv_blocks: int = 1 << 20):
        self.num_kv_blocks = num_kv_blocks
        self.seconds = 0.0
        self.last_batch: tuple[bool, int] | None = None     # (is_prefill, num_seqs)

    def execute(self, batch, sampling) -> np.ndarray:
        start = time.perf_counter()
        tokens = next_tokens(batch)
        self.last_batch = (batch.is_prefill, batch.num_seqs)
        self.seconds += time.perf_counter() - start
        return tokens


def next_tokens(batch) -> np.ndarray:
    """InstantRunner's token: a hash of each sequence's last new token and its position (an
    ordinary Llama 3 token, never EOS)."""
    last = batch.last_token_indices
    h = batch.token_ids[last].astype(np.int64) * 7919 + batch.positions[last].astype(np.int64) * 104729
    lo, hi = OUTPUT_TOKEN_IDS
    return (h % (hi - lo) + lo).astype(np.int32)


def model_dir() -> Path:
    if not (MODEL_DIR / "config.json").is_file():
        from tinyvllm.checkpoint.model_writer import write_model
        write_model(MODEL_DIR, preset="tiny", seed=0)
    return MODEL_DIR


def requests(name: str, seed: int, scale: float) -> list[tuple[list[int], int]]:
    n, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(p_lo, p_hi + 1, n)
    output_lens = rng.integers(o_lo, o_hi + 1, n)
    return [(rng.integers(0, PROMPT_TOKEN_ID_LIMIT, int(p)).tolist(), max(1, int(o * scale)))
            for p, o in zip(prompt_lens, output_lens)]


def new_engine(max_num_seqs: int = 256, stats: bool = False) -> tuple[LLMEngine, InstantRunner]:
    runner = InstantRunner()
    engine = LLMEngine(model_dir(), runner=runner, device="cpu", max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=16384)
    if stats:
        engine.enable_stats()
    return engine, runner


def run(engine: LLMEngine, runner: InstantRunner, reqs, consumer: str, profiler=None) -> dict:
    """All requests at once, step by step; -> host seconds per step, by kind."""
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          ignore_eos=True))
    decode, prefill, finals = [], [], {}
    if profiler:
        profiler.enable()
    while engine.has_unfinished_requests():
        runner.seconds, runner.last_batch = 0.0, None
        start = time.perf_counter()
        for out in engine.step():
            if consumer == "stream":      # what the server's _snapshot reads
                for o in out.outputs:
                    (o.delta_text, len(out.prompt_token_ids), o.num_generated_tokens, o.finished,
                     o.finish_reason)
            if out.finished:
                finals[out.request_id] = out
        host = time.perf_counter() - start - runner.seconds
        if runner.last_batch is not None:
            is_prefill, num_seqs = runner.last_batch
            (prefill if is_prefill else decode).append((host, num_seqs))
    start = time.perf_counter()
    text_chars = sum(len(out.outputs[0].text) for out in finals.values())
    final_text = time.perf_counter() - start
    if profiler:
        profiler.disable()
    return {"decode": decode, "prefill": prefill, "final_text": final_text, "chars": text_chars,
            "tokens": sum(len(out.outputs[0].token_ids) for out in finals.values())}   # (finals dropped)


def summarize(name: str, consumer: str, r: dict) -> list[str]:
    d = r["decode"]
    d_us = [1e6 * h for h, _ in d]
    seq_steps = sum(n for _, n in d)
    p_us = [1e6 * h for h, _ in r["prefill"]]
    return [name, consumer, f"{len(d)}", f"{seq_steps / max(len(d), 1):.0f}",
            f"{statistics.mean(d_us):.0f}" if d else "-", f"{statistics.median(d_us):.0f}" if d else "-",
            f"{sum(d_us) / max(seq_steps, 1):.2f}",
            f"{len(p_us)}", f"{statistics.mean(p_us):.0f}" if p_us else "-",
            f"{1e3 * r['final_text']:.1f}", f"{(sum(d_us) + sum(p_us)) / 1e6 + r['final_text']:.2f}"]


HEADER = ["workload", "consumer", "decode steps", "seqs/step", "us/decode step", "median",
          "us/seq-step", "prefill steps", "us/prefill", "final text ms", "host s total"]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    print(line(HEADER))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--consumer", nargs="+", choices=["offline", "stream"], default=["offline", "stream"])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply output lengths by this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile each run; print the top 20")
    ap.add_argument("--stats", action="store_true",
                    help="engine.enable_stats(): the StepStats the server collects every step")
    args = ap.parse_args(argv)

    engine, runner = new_engine()
    run(engine, runner, requests("batch64", args.seed, 0.1), "stream")       # warm-up
    rows = []
    for name in args.workload:
        for consumer in args.consumer:
            engine, runner = new_engine(stats=args.stats)
            gc.collect()          # start each run without the previous runs' garbage
            profiler = cProfile.Profile() if args.profile else None
            result = run(engine, runner, requests(name, args.seed, args.scale), consumer, profiler)
            rows.append(summarize(name, consumer, result))
            print(f"{name}/{consumer}: {result['tokens']} tokens, {result['chars']} chars",
                  file=sys.stderr)
            if profiler:
                print(f"\n== cProfile {name}/{consumer} (whole run incl. profiler overhead) ==")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    print_table(rows)


if __name__ == "__main__":
    main()
