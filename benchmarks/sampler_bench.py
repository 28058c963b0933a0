"""The sampler's GPU time per step, at each batch size, for: plain greedy, plain sampled, sampled
with penalties on every row, sampled with logprobs=5 on every row — the device work a
CudaRunner step does after the LM head, launch for launch (gpu/step_sampling.py): the raw-logits copy
and step_logprobs when logprobs are asked for, the edit upload and apply_logit_edits when
penalties are on, sample_tokens always. Also the host time to build the step's SamplingBatch.

    python benchmarks/sampler_bench.py [--batch 1 256] [--vocab 128256] [--prompt 1000] [--output 200]

GPU time: the step's work captured into one CUDA graph, CUDA events around each replay, median
of --repeats; the logits are restored from a pristine copy before each replay (outside the timed
span: the sampler works in place).
On a checkout without issue 11's kernels (main before it) the rows it cannot run print n/a,
so the same script gives the before and after tables.
"""
from __future__ import annotations

import argparse
import inspect
import time

import numpy as np

PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
SAMPLED = dict(temperature=0.8, top_p=0.95)


def configs():
    return {"plain greedy": dict(temperature=0.0), "plain sampled": dict(SAMPLED),
            "penalties (all rows)": dict(SAMPLED, **PENALTIES), "logprobs=5 (all rows)": dict(SAMPLED, logprobs=5)}


def make_batch(num_seqs: int, params: dict, prompt: int, output: int, vocab: int, rng):
    """The step's SamplingBatch built as the engine builds it (from_sequences over Sequences
    with prompt + output tokens), and its host build time; None where this checkout lacks it."""
    from tinyvllm.engine.batch import SamplingBatch
    from tinyvllm.engine.sampling_params import SamplingParams
    from tinyvllm.engine.sequence import Sequence
    try:
        sp = SamplingParams(max_tokens=10**6, **params).validate()
    except TypeError:
        return None, None                       # a field this checkout does not have
    seqs = []
    for i in range(num_seqs):
        s = Sequence(str(i), None, rng.integers(0, vocab, prompt).tolist(), sp, seed=i, detokenizer=None)
        s.token_ids.extend(rng.integers(0, vocab, output).tolist())
        seqs.append(s)
    if not hasattr(SamplingBatch, "from_sequences"):
        build = lambda: SamplingBatch.build([sp.temperature] * num_seqs, [sp.top_k] * num_seqs,  # noqa: E731
                                            [sp.top_p] * num_seqs, range(num_seqs), [output] * num_seqs)
    else:
        build = lambda: SamplingBatch.from_sequences(seqs, (vocab - 1,))  # noqa: E731
    batch = build()                             # the first build makes the per-sequence counts
    times = []
    for _ in range(5):
        seqs[0].token_ids.append(int(rng.integers(0, vocab)))    # one new token, as a step adds
        t0 = time.perf_counter()
        batch = build()
        if getattr(batch, "edits", None) is not None:
            batch.edits.packed()
        times.append(time.perf_counter() - t0)
    return batch, float(np.median(times))


def time_step(drv, ops, batch, vocab: int, repeats: int, rng) -> float:
    """Median GPU seconds of one step's sampler work for this batch."""
    from tinyvllm.gpu.graphs import CudaGraph
    n = batch.num_seqs
    pristine = drv.to_device((rng.standard_normal((n, vocab)) * 4).astype(np.float32))
    logits = drv.mem_alloc(n * vocab * 4)
    dev = {name: drv.to_device(np.ascontiguousarray(a)) for name, a in (
        ("temperature", batch.temperature), ("top_k", batch.top_k), ("top_p", batch.top_p),
        ("seed", batch.seed), ("step", batch.step))}
    out = drv.mem_alloc(4 * n)
    has_min_p = "min_p" in inspect.signature(ops.sample).parameters
    min_p_dev = drv.to_device(batch.min_p) if has_min_p else None      # held for the whole loop
    extra = {"min_p": int(min_p_dev)} if has_min_p else {}
    edits = getattr(batch, "edits", None)
    rows = batch.logprob_rows if hasattr(batch, "logprob_rows") else np.zeros(0, np.int32)
    if edits is not None:
        packed = edits.packed()
        edits_host = drv.pagelocked_empty(packed.shape, np.int32)
        edits_host[:] = packed
        edits_dev = drv.mem_alloc(packed.nbytes)
    if len(rows):
        k, r = batch.logprob_k, len(rows)
        raw = drv.mem_alloc(n * vocab * 4)
        rows_host = drv.pagelocked_empty(r, np.int32)
        rows_host[:] = rows
        rows_dev = drv.mem_alloc(4 * r)
        lp_out = drv.mem_alloc(4 * r * (2 + 2 * k))
        lp_host = drv.pagelocked_empty(r * (2 + 2 * k), np.int32)
    stream = ops.stream

    def work():
        if len(rows):
            drv.memcpy_dtod_async(raw, logits, n * vocab * 4, stream)
        if edits is not None:
            drv.memcpy_htod_async(edits_dev, edits_host, stream)
            ops.apply_logit_edits(int(logits), vocab, int(edits_dev), edits.num_entries)
        ops.sample(int(logits), n, vocab, *(int(dev[x]) for x in ("temperature", "top_k", "top_p", "seed", "step")),
                   int(out), **extra)
        if len(rows):
            drv.memcpy_htod_async(rows_dev, rows_host, stream)
            base = int(lp_out)
            ops.step_logprobs(int(raw), vocab, r, int(out), k, base, base + 4 * r, base + 8 * r,
                              base + (8 + 4 * k) * r, rows=int(rows_dev))
            drv.memcpy_dtoh_async(lp_host, lp_out, stream)

    # one graph of the step's work, so that the events time the GPU, not Python's launches
    drv.memcpy_dtod(logits, pristine, n * vocab * 4)
    work()
    stream.synchronize()
    with CudaGraph.capture(stream) as graph:
        work()
    start, end = drv.Event(), drv.Event()
    times = []
    for _ in range(repeats + 3):
        drv.memcpy_dtod_async(logits, pristine, n * vocab * 4, stream)   # it works in place
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(end.time_since(start) / 1e3)
    graph.close()
    return float(np.median(times[3:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens per row (penalties' counts)")
    ap.add_argument("--output", type=int, default=200, help="generated tokens per row")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()

    import pycuda.driver as drv

    from tinyvllm.gpu.driver import CudaDevice
    from tinyvllm.gpu.kernels import KernelLibrary
    from tinyvllm.gpu.ops import GpuOps
    device = CudaDevice()
    rng = np.random.default_rng(0)
    with device.active():
        ops = GpuOps(KernelLibrary(), stream=drv.Stream(), blas=None, num_sms=device.num_sms)
        print(f"{device.name}, vocab {args.vocab}, rows of {args.prompt} prompt + {args.output} output tokens")
        print(f"{'config':<24}{'batch':>6}{'GPU us/step':>13}{'edits':>9}{'host build ms':>15}")
        for name, params in configs().items():
            for b in args.batch:
                batch, host = make_batch(b, params, args.prompt, args.output, args.vocab, rng)
                supported = batch is not None and (
                    ("logprobs" not in params or hasattr(ops, "step_logprobs"))
                    and (not set(PENALTIES) & set(params) or hasattr(ops, "apply_logit_edits")))
                if not supported:
                    print(f"{name:<24}{b:>6}{'n/a':>13}")
                    continue
                gpu = time_step(drv, ops, batch, args.vocab, args.repeats, rng)
                edits = getattr(batch, "edits", None)
                print(f"{name:<24}{b:>6}{gpu * 1e6:>13.1f}{edits.num_entries if edits is not None else 0:>9}"
                      f"{host * 1e3:>15.3f}")


if __name__ == "__main__":
    main()
