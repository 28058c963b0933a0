"""`python -m tinyvllm bench`: the project's performance numbers, measured the same way every
time, printed as a table and written to JSON (where it ran: bench/machine.py).

Workloads (random token-id prompts, greedy, ignore_eos, so every request runs to its length):
  latency     1 request, 128 prompt + 256 new tokens. decode tok/s = (tokens - 1) / (time after
              the first token); TTFT; and the fraction of the bandwidth floor, where
              floor tok/s = device copy bandwidth / weight bytes (a decode step must read every
              weight once, so no engine beats it at batch 1).
  throughput  nano-vllm's benchmark: 256 requests, prompt and output lengths uniform in
              [100, 1024], all submitted at once. output tok/s = generated / wall time.
  batch64     64 requests of 128 prompt + 128 new tokens. output tok/s.
  prefix      256 requests: one shared 1,024-token system prompt + 64-256 tokens each, 128 new
              tokens, all at once; run on two engines, the prefix cache on and off (the rest of
              the options the same): TTFT p50/p99, output tok/s, hit rate, and whether the greedy
              outputs are identical. Every other run starts from an empty prefix cache.
`--compare-hf` runs the same workloads with HF transformers (bench/hf.py), `--compare-vllm` with
vLLM's offline LLM in a process of its own after tinyvllm's engines have closed (bench/vllm.py);
the specs and results are bench/workloads.py's.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tinyvllm.bench import vllm
from tinyvllm.bench.floor import floor_output_tok_s
from tinyvllm.bench.hf import HFBench, check_available
from tinyvllm.bench.machine import device_info, git_commit
from tinyvllm.bench.options import BenchOptions
from tinyvllm.bench.report import BenchReport, format_table
from tinyvllm.bench.workloads import (
    WARMUP,
    WorkloadResult,
    WorkloadSpec,
    select_workloads,
    shrink,
)
from tinyvllm.checkpoint.default_model import DEFAULT_MODEL, default_model_dir
from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, is_gguf_file
from tinyvllm.checkpoint.model_writer import preset_config, write_model
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.llm import LLM
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import TinyVLLMError

ENGINE_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 16384}


# -- the model and the engine ----------------------------------------------------------------
def resolve_model(model: str | None, preset: str, cache_dir: Path) -> Path:
    """--model as given, else the preset's random-weight model, written once into the cache.
    Written to a temporary sibling and renamed, so an interrupted write is never reused."""
    if model:
        return Path(model)
    if preset == DEFAULT_MODEL:                     # real weights, in the default model's cache
        return default_model_dir()
    preset_config(preset)                           # an unknown preset fails before any writing
    final = cache_dir / preset
    if (final / "config.json").is_file():
        return final
    partial = cache_dir / f".{preset}.partial"
    print(f"writing the {preset} model to {final} (once) ...", file=sys.stderr)
    write_model(partial, preset=preset, seed=0)
    partial.rename(final)
    return final


def kv_blocks_needed(specs: list[WorkloadSpec], max_num_seqs: int, block_size: int) -> int:
    """Enough blocks that no workload is preempted: every sequence that can run at once at its
    longest context. Sized this way rather than from free memory so that HF fits beside us."""
    return max(min(s.num_requests, max_num_seqs) * math.ceil(s.max_context / block_size)
               for s in [*specs, *WARMUP])


def engine_options(user_options: dict, specs: list[WorkloadSpec]) -> dict:
    options = {**ENGINE_DEFAULTS, **user_options}
    if "kv_cache_gb" not in options and "num_kv_blocks" not in options:
        options["num_kv_blocks"] = kv_blocks_needed(
            specs, options["max_num_seqs"], options.get("block_size", EngineConfig.block_size))
        # a cache sized for the workloads holds their longest context, not the model's
        options.setdefault("max_model_len", max(s.max_context for s in [*specs, *WARMUP]))
    return options


# -- measuring -------------------------------------------------------------------------------
def run_tinyvllm(llm, spec: WorkloadSpec, seed: int) -> WorkloadResult:
    return run_tinyvllm_outputs(llm, spec, seed)[0]


def run_tinyvllm_outputs(llm, spec: WorkloadSpec, seed: int) -> tuple[WorkloadResult, list]:
    """All of a workload's requests through LLM.generate at once; latency-style metrics (TTFT,
    decode rate) from the engine's own per-request timings, medians over the repeats. Each
    repeat starts from an empty prefix cache: no run hits the blocks of the one before.
    -> (the result, the last repeat's RequestOutputs)."""
    requests = spec.requests(seed)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    walls, ttfts, rates = [], [], []
    engine = llm.engine
    preemptions_before, stats = engine.num_preemptions, engine.prefix_cache_stats
    for _ in range(spec.repeats):
        engine.reset_prefix_cache()
        queries_before, hits_before = stats.queries, stats.hits
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params,
                               use_tqdm=False)
        walls.append(time.perf_counter() - start)
        ttfts += [t for o in outputs if (t := o.metrics.time_to_first_token) is not None]
        rates += [r for o in outputs if (r := o.metrics.decode_tokens_per_s)]
    result = WorkloadResult(
        "tinyvllm", num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        preemptions=(engine.num_preemptions - preemptions_before) // spec.repeats)
    if spec.num_requests == 1:
        result.ttft_ms = 1000 * statistics.median(ttfts)
        result.decode_tok_s = statistics.median(rates) if rates else None
    if spec.shared_prefix:
        result.ttft_ms, result.ttft_p99_ms = (1000 * float(np.percentile(ttfts, q)) for q in (50, 99))
        queries = stats.queries - queries_before
        result.prefix_cache_hit_rate = (stats.hits - hits_before) / queries if queries else 0.0
    return result.finish(statistics.median(walls)), outputs


def warm_up(llm, seed: int, max_len: int | None) -> None:
    for spec in WARMUP:
        run_tinyvllm(llm, shrink(spec, max_len=max_len), seed)


# -- the command -----------------------------------------------------------------------------
def run_bench(opts: BenchOptions, out=None):
    """Run the workloads with tinyvllm, then (--compare-hf) with HF and (--compare-vllm) with vLLM,
    print the table, write JSON. -> the BenchReport."""
    out = out or sys.stdout
    specs = select_workloads(opts.workload, opts.num_requests, opts.min_len, opts.max_len)
    options = engine_options(opts.engine_options, specs)
    device = options.get("device", "cuda")
    if opts.compare_hf:
        if opts.hf_max_seconds <= 0:
            raise TinyVLLMError(f"--hf-max-seconds must be > 0, got {opts.hf_max_seconds:g}")
        check_available()                          # before minutes of tinyvllm runs, not after
    if opts.compare_vllm:
        if opts.vllm_max_seconds <= 0:
            raise TinyVLLMError(f"--vllm-max-seconds must be > 0, got {opts.vllm_max_seconds:g}")
        vllm.check_available(opts.vllm_site)
    model_dir = resolve_model(opts.model, opts.preset, Path(opts.model_cache))
    model_config = ModelConfig.from_pretrained(gguf_model_dir(model_dir) if is_gguf_file(model_dir) else model_dir)
    ours, engine_config = run_tinyvllm_workloads(model_dir, options, specs, opts)
    report_device = ours.pop("_device")
    report = BenchReport(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=git_commit(), device=report_device,
        model={"path": str(model_dir), "preset": None if opts.model else opts.preset,
               "num_parameters": model_config.num_parameters,
               "weight_bytes": report_device.pop("weight_bytes", None) or model_config.decode_parameters * 2},
        engine_config=engine_config)
    # the floors' bandwidth: every GPU's (each rank reads its share of the weights and K/V; the
    # ranks' cards taken as alike, device 0 measured)
    gpus = report.device["gpus"] = engine_config.get("tensor_parallel_size") or 1
    bandwidth = report.device.get("copy_bandwidth_GBps") and report.device["copy_bandwidth_GBps"] * gpus
    report.device["floor_tok_s"] = bandwidth * 1e9 / report.model["weight_bytes"] if bandwidth else None
    hf, theirs = {}, {}
    if opts.compare_hf:
        hf, report.hf = run_hf_workloads(model_dir, device, specs, opts)
    if opts.compare_vllm:              # last: HF's torch has let go of its cached GPU memory
        theirs, report.vllm = vllm.run_vllm_workloads(model_dir, specs, opts.seed, opts.max_len,
                                                      opts.vllm_site, opts.vllm_max_seconds)
    for spec in specs:
        floor = floor_output_tok_s(spec, opts.seed, model_config, report.model["weight_bytes"], bandwidth * 1e9) \
            if bandwidth and spec.name != "latency" else None
        report.add(spec, ours[spec.name], hf.get(spec.name), theirs.get(spec.name), floor_output_tok_s=floor)
    out.write(format_table(report))
    if opts.json_path:
        Path(opts.json_path).write_text(report.to_json())
        out.write(f"wrote {opts.json_path}\n")
    return report


def run_tinyvllm_workloads(model_dir: Path, options: dict, specs: list[WorkloadSpec],
                           opts: BenchOptions) -> tuple[dict, dict]:
    """-> ({workload: result, "_device": device info}, the engine config used). The engine is
    closed and dropped before returning, so that its GPU memory is free for HF and vLLM."""
    llm = LLM(model_dir, **options)
    outputs = {}
    try:
        results = {"_device": device_info(llm.engine.engine_config.device)}
        # quantized weights: the floor counts the bytes a decode step streams (DeviceWeights)
        weights = getattr(llm.engine.runner, "weights", None)
        results["_device"]["weight_bytes"] = weights.streamed_bytes if getattr(weights, "quantized", False) else None
        engine_config = dataclasses.asdict(llm.engine.engine_config)
        engine_config["num_kv_blocks"] = llm.engine.block_manager.num_blocks
        caching = llm.engine.engine_config.enable_prefix_caching
        warm_up(llm, opts.seed, opts.max_len)
        for spec in specs:
            print(f"tinyvllm: {spec.name} ...", file=sys.stderr, end=" ", flush=True)
            results[spec.name], outputs[spec.name] = run_tinyvllm_outputs(llm, spec, opts.seed)
            print(progress_line(results[spec.name]), file=sys.stderr)
    finally:
        llm.engine.close()
        del llm
        gc.collect()                   # the runner's device allocations go with their objects
    for spec in (s for s in specs if s.shared_prefix):
        results[spec.name] = compare_prefix_cache(model_dir, options, spec, opts, caching,
                                                  results[spec.name], outputs[spec.name])
    return results, engine_config


def compare_prefix_cache(model_dir: Path, options: dict, spec: WorkloadSpec, opts: BenchOptions,
                         caching: bool, result: WorkloadResult, outputs: list) -> WorkloadResult:
    """Run `spec` again on an engine with the prefix cache the other way round. -> the cache-on
    result, the cache-off one nested in it, and whether the greedy outputs are identical."""
    llm = LLM(model_dir, **{**options, "enable_prefix_caching": not caching})
    try:
        warm_up(llm, opts.seed, opts.max_len)
        label = "off" if caching else "on"
        print(f"tinyvllm: {spec.name} (prefix cache {label}) ...", file=sys.stderr, end=" ", flush=True)
        other, other_outputs = run_tinyvllm_outputs(llm, spec, opts.seed)
        print(progress_line(other), file=sys.stderr)
    finally:
        llm.engine.close()
        del llm
        gc.collect()
    on, off = (result, other) if caching else (other, result)
    on.cache_off, off.prefix_cache_hit_rate = off, None
    on.outputs_identical = [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in other_outputs]
    return on


def progress_line(result: WorkloadResult) -> str:
    """What a run gave, on stderr as it ends: a run cut short by a timeout still leaves this."""
    if result.wall_s is None:
        return result.note or "n/a"
    decode = f", decode {result.decode_tok_s:,.1f} tok/s" if result.decode_tok_s else ""
    return f"{result.output_tok_s:,.1f} output tok/s in {result.wall_s:.2f} s{decode}"


def run_hf_workloads(model_dir: Path, device: str, specs: list[WorkloadSpec],
                     opts: BenchOptions) -> tuple[dict, dict]:
    """-> ({workload: result}, what ran them)."""
    hf = HFBench(model_dir, device, opts.hf_max_seconds)
    about = {**hf.versions, "device": device, "max_seconds": opts.hf_max_seconds}
    try:
        results = {}
        hf.warm_up(specs[0].requests(opts.seed))
        for spec in specs:
            print(f"HF transformers: {spec.name} ...", file=sys.stderr, end=" ", flush=True)
            results[spec.name] = hf.run(spec, spec.requests(opts.seed))
            print(progress_line(results[spec.name]), file=sys.stderr)
    finally:
        hf.close()
    return results, about

