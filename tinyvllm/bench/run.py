"""`python -m tinyvllm bench`: the project's three performance numbers, measured the same way
every time, printed as a table and written to JSON.

Workloads (random token-id prompts, greedy, ignore_eos, so every request runs to its length):
  latency     1 request, 128 prompt + 256 new tokens. decode tok/s = (tokens - 1) / (time after
              the first token); TTFT; and the fraction of the bandwidth floor, where
              floor tok/s = device copy bandwidth / weight bytes (a decode step must read every
              weight once, so no engine beats it at batch 1).
  throughput  nano-vllm's benchmark: 256 requests, prompt and output lengths uniform in
              [100, 1024], all submitted at once. output tok/s = generated / wall time.
  batch64     64 requests of 128 prompt + 128 new tokens. output tok/s.
`--compare-hf` runs the same workloads with HF transformers (tinyvllm/bench_hf.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tinyvllm.errors import TinyVLLMError

DEFAULT_MODEL_CACHE = Path("/tmp/tinyvllm-models")
PROMPT_TOKEN_ID_LIMIT = 10_000        # ids drawn from [0, 10000), as nano-vllm's benchmark does
ENGINE_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 16384}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_requests: int
    prompt_len: tuple[int, int]       # inclusive range; equal ends = a fixed length
    output_len: tuple[int, int]
    target_metric: str                # the metric the issue sets a target for ...
    target: float                     # ... and its value
    repeats: int = 1                  # runs; the median is reported (the latency run is short)

    @property
    def max_context(self) -> int:
        return self.prompt_len[1] + self.output_len[1]

    def requests(self, seed: int) -> list["BenchRequest"]:
        rng = np.random.default_rng(seed)
        prompt_lens = rng.integers(self.prompt_len[0], self.prompt_len[1] + 1, self.num_requests)
        output_lens = rng.integers(self.output_len[0], self.output_len[1] + 1, self.num_requests)
        return [BenchRequest(rng.integers(0, PROMPT_TOKEN_ID_LIMIT, int(p)).tolist(), int(o))
                for p, o in zip(prompt_lens, output_lens)]


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


WORKLOADS = {
    "latency": WorkloadSpec("latency", 1, (128, 128), (256, 256), "decode_tok_s", 1300, repeats=3),
    "batch64": WorkloadSpec("batch64", 64, (128, 128), (128, 128), "output_tok_s", 20000),
    "throughput": WorkloadSpec("throughput", 256, (100, 1024), (100, 1024), "output_tok_s", 40000),
}   # in run order: HF's estimate of the throughput run needs its batch64 timing
# Prefill at batch 1 and a small decode batch, so that compiling, first calls and graph capture
# are paid before anything is timed.
WARMUP = [WorkloadSpec("warmup", 1, (128, 128), (16, 16), "", 0),
          WorkloadSpec("warmup", 8, (32, 32), (8, 8), "", 0)]


def select_workloads(name: str, num_requests: int | None = None, min_len: int | None = None,
                     max_len: int | None = None) -> list[WorkloadSpec]:
    """The workloads to run, shrunk by the overrides for small (CPU) runs: --num-requests
    replaces every multi-request count, a fixed length is capped at --max-len, a ragged range
    becomes [--min-len, --max-len]."""
    if num_requests is not None and num_requests < 1:
        raise TinyVLLMError(f"--num-requests must be >= 1, got {num_requests}")
    if min_len is not None and min_len < 1:
        raise TinyVLLMError(f"--min-len must be >= 1, got {min_len}")
    if max_len is not None and max_len < 2:
        raise TinyVLLMError(f"--max-len must be >= 2 (one token after the first), got {max_len}")
    if min_len is not None and max_len is not None and min_len > max_len:
        raise TinyVLLMError(f"--min-len {min_len} is larger than --max-len {max_len}")
    names = list(WORKLOADS) if name == "all" else [name]
    return [shrink(WORKLOADS[n], num_requests, min_len, max_len) for n in names]


def shrink(spec: WorkloadSpec, num_requests=None, min_len=None, max_len=None) -> WorkloadSpec:
    def lengths(lo, hi):
        if lo == hi:
            return (min(lo, max_len),) * 2 if max_len else (lo, hi)
        lo, hi = min_len or lo, max_len or hi
        return min(lo, hi), hi
    count = num_requests if num_requests and spec.num_requests > 1 else spec.num_requests
    return dataclasses.replace(spec, num_requests=count, prompt_len=lengths(*spec.prompt_len),
                               output_len=lengths(*spec.output_len))


@dataclass
class WorkloadResult:
    backend: str                       # "tinyvllm" or "hf"
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float | None = None
    output_tok_s: float | None = None
    total_tok_s: float | None = None   # (prompt + generated) / wall
    decode_tok_s: float | None = None  # batch 1: tokens after the first / time after the first
    ms_per_token: float | None = None
    ttft_ms: float | None = None
    preemptions: int | None = None
    note: str | None = None            # why a number is missing, or how it was measured

    def finish(self, wall_s: float) -> "WorkloadResult":
        self.wall_s = wall_s
        self.output_tok_s = self.output_tokens / wall_s
        self.total_tok_s = (self.prompt_tokens + self.output_tokens) / wall_s
        if self.decode_tok_s:
            self.ms_per_token = 1000.0 / self.decode_tok_s
        return self


# -- the model and the engine ----------------------------------------------------------------
def resolve_model(model: str | None, preset: str, cache_dir: Path) -> Path:
    """--model as given, else the preset's random-weight model, written once into the cache.
    Written to a temporary sibling and renamed, so an interrupted write is never reused."""
    if model:
        return Path(model)
    from tinyvllm.checkpoint.model_writer import preset_config, write_model
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
    from tinyvllm.config import EngineConfig
    options = {**ENGINE_DEFAULTS, **user_options}
    if "kv_cache_gb" not in options and "num_kv_blocks" not in options:
        options["num_kv_blocks"] = kv_blocks_needed(
            specs, options["max_num_seqs"], options.get("block_size", EngineConfig.block_size))
    return options


# -- measuring -------------------------------------------------------------------------------
def measure_copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 5) -> float:
    """Device-to-device memcpy bandwidth in bytes/s, read + write counted: the most bytes per
    second any kernel can stream. Median of `repeats` timed copies after one warm-up copy."""
    import pycuda.driver as drv
    drv.init()
    ctx = drv.Device(0).retain_primary_context()    # the context the engine uses too
    ctx.push()
    try:
        src, dst = drv.mem_alloc(nbytes), drv.mem_alloc(nbytes)
        stream, start, end = drv.Stream(), drv.Event(), drv.Event()
        seconds = []
        for i in range(repeats + 1):
            start.record(stream)
            drv.memcpy_dtod_async(dst, src, nbytes, stream)
            end.record(stream)
            end.synchronize()
            if i:
                seconds.append(end.time_since(start) / 1e3)
        src.free()
        dst.free()
    finally:
        ctx.pop()
    return 2 * nbytes / statistics.median(seconds)


def run_tinyvllm(llm, spec: WorkloadSpec, seed: int) -> WorkloadResult:
    """All of a workload's requests through LLM.generate at once; latency-style metrics (TTFT,
    decode rate) from the engine's own per-request timings, medians over the repeats."""
    from tinyvllm.engine.sampling_params import SamplingParams
    requests = spec.requests(seed)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    walls, ttfts, rates = [], [], []
    preemptions_before = llm.engine.num_preemptions
    for _ in range(spec.repeats):
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params)
        walls.append(time.perf_counter() - start)
        ttfts += [o.time_to_first_token for o in outputs if o.time_to_first_token is not None]
        rates += [o.decode_tokens_per_s for o in outputs if o.decode_tokens_per_s]
    result = WorkloadResult(
        "tinyvllm", num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(len(o.token_ids) for o in outputs),
        preemptions=(llm.engine.num_preemptions - preemptions_before) // spec.repeats)
    if spec.num_requests == 1:
        result.ttft_ms = 1000 * statistics.median(ttfts)
        result.decode_tok_s = statistics.median(rates) if rates else None
    return result.finish(statistics.median(walls))


def warm_up(llm, seed: int, max_len: int | None) -> None:
    for spec in WARMUP:
        run_tinyvllm(llm, shrink(spec, max_len=max_len), seed)


# -- the machine -----------------------------------------------------------------------------
def git_commit() -> str | None:
    """The checkout's commit, with "-dirty" when the working tree has changes; None outside git."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"],
                             cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def device_info(device: str) -> dict:
    if device == "cpu":
        return {"kind": "cpu", "name": f"cpu ({platform.processor() or platform.machine()}, numpy "
                                      f"reference backend)", "copy_bandwidth_GBps": None}
    import pycuda.driver as drv
    drv.init()
    return {"kind": "cuda", "name": drv.Device(0).name(),
            "copy_bandwidth_GBps": measure_copy_bandwidth() / 1e9}


# -- the command -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchOptions:
    model: str | None = None           # a model directory; None = the preset's random model
    preset: str = "llama-3.2-1b"
    model_cache: Path = DEFAULT_MODEL_CACHE
    workload: str = "all"
    json_path: str | None = None
    compare_hf: bool = False
    hf_max_seconds: float = 180.0      # all HF runs together
    engine_options: dict = field(default_factory=dict)   # EngineConfig fields the user set
    num_requests: int | None = None
    min_len: int | None = None
    max_len: int | None = None
    seed: int = 0


def run_bench(opts: BenchOptions, out=None):
    """Run the workloads with tinyvllm, then (--compare-hf) with HF, print the table, write JSON.
    -> the BenchReport."""
    from tinyvllm.bench.report import BenchReport, format_table
    from tinyvllm.config import ModelConfig
    out = out or sys.stdout
    specs = select_workloads(opts.workload, opts.num_requests, opts.min_len, opts.max_len)
    options = engine_options(opts.engine_options, specs)
    device = options.get("device", "cuda")
    if opts.compare_hf:
        from tinyvllm.bench.hf import check_available
        if opts.hf_max_seconds <= 0:
            raise TinyVLLMError(f"--hf-max-seconds must be > 0, got {opts.hf_max_seconds:g}")
        check_available()                          # before minutes of tinyvllm runs, not after
    model_dir = resolve_model(opts.model, opts.preset, Path(opts.model_cache))
    model_config = ModelConfig.from_pretrained(model_dir)
    ours, engine_config = run_tinyvllm_workloads(model_dir, options, specs, opts)
    report = BenchReport(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=git_commit(), device=ours.pop("_device"),
        model={"path": str(model_dir), "preset": None if opts.model else opts.preset,
               "num_parameters": model_config.num_parameters,
               "weight_bytes": model_config.num_parameters * 2},
        engine_config=engine_config)
    bandwidth = report.device.get("copy_bandwidth_GBps")
    report.device["floor_tok_s"] = bandwidth * 1e9 / report.model["weight_bytes"] if bandwidth else None
    hf = {}
    if opts.compare_hf:
        hf, report.hf = run_hf_workloads(model_dir, device, specs, opts)
    for spec in specs:
        report.add(spec, ours[spec.name], hf.get(spec.name))
    out.write(format_table(report))
    if opts.json_path:
        Path(opts.json_path).write_text(report.to_json())
        out.write(f"wrote {opts.json_path}\n")
    return report


def run_tinyvllm_workloads(model_dir: Path, options: dict, specs: list[WorkloadSpec],
                           opts: BenchOptions) -> tuple[dict, dict]:
    """-> ({workload: result, "_device": device info}, the engine config used). The engine is
    closed and dropped before returning, so that its GPU memory is free for HF."""
    import gc
    from tinyvllm.engine.llm import LLM
    llm = LLM(model_dir, **options)
    try:
        results = {"_device": device_info(llm.engine.engine_config.device)}
        engine_config = dataclasses.asdict(llm.engine.engine_config)
        engine_config["num_kv_blocks"] = llm.engine.block_manager.num_blocks
        warm_up(llm, opts.seed, opts.max_len)
        for spec in specs:
            print(f"tinyvllm: {spec.name} ...", file=sys.stderr, end=" ", flush=True)
            results[spec.name] = run_tinyvllm(llm, spec, opts.seed)
            print(progress_line(results[spec.name]), file=sys.stderr)
    finally:
        llm.engine.close()
        del llm
        gc.collect()                   # the runner's device allocations go with their objects
    return results, engine_config


def progress_line(result: WorkloadResult) -> str:
    """What a run gave, on stderr as it ends: a run cut short by a timeout still leaves this."""
    if result.wall_s is None:
        return result.note or "n/a"
    decode = f", decode {result.decode_tok_s:,.1f} tok/s" if result.decode_tok_s else ""
    return f"{result.output_tok_s:,.1f} output tok/s in {result.wall_s:.2f} s{decode}"


def run_hf_workloads(model_dir: Path, device: str, specs: list[WorkloadSpec],
                     opts: BenchOptions) -> tuple[dict, dict]:
    """-> ({workload: result}, what ran them)."""
    from tinyvllm.bench.hf import HFBench
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
