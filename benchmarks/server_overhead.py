#!/usr/bin/env python3
"""The server's host side under load, on the CPU: the real app, EngineLoop and LLMEngine, with
the GPU replaced by a simulated one.

The app runs under uvicorn in this process (an event-loop thread and the engine thread, as in
`tinyvllm serve`) on a free 127.0.0.1 port; load_server.py's client runs in a child process (so
that its parsing does not share this process's GIL), and what the run measured is printed as one
table row: output tok/s, inter-token latency, engine steps a second, the mean step, the
simulated GPU's busy fraction and the GPU's idle time a step (the host gap).

    python benchmarks/server_overhead.py                              # the mixed load, H100 model
    python benchmarks/server_overhead.py --max-num-batched-tokens 2048 --no-stats
    python benchmarks/server_overhead.py --profile                    # cProfile both server threads
    python benchmarks/server_overhead.py --profile engine             # one of them (Python 3.12+)
    python benchmarks/server_overhead.py --sweep                      # SWEEP's variants, a row each
    python benchmarks/server_overhead.py --variant= --variant=--no-stats --rounds 3   # an A/B
    python benchmarks/server_overhead.py --runner instant --workload uniform --step-ms 2
    python benchmarks/server_overhead.py --runner cuda               # on a GPU: the same, measured

Probes of the host side (flags): --gil-releases N (a launch lets go of the GIL N times, as the
CUDA runner's PyCUDA copies and event waits do), --switch-interval-ms (the interpreter's GIL
switch interval).

Runners (--runner):
  simulated  SimulatedGpuRunner: behaves like a CUDA stream with an H100 running Llama-3.2-1B
             (DeviceModel below). launch() computes the step's tokens at once, then spends the
             step's modeled enqueue time as Python busy work holding the GIL (an eager
             prefill-kind step launches ~180 kernels and cuBLAS calls at ~19 us each; a decode
             step replays a CUDA graph, ~0.1 ms), and puts the step's modeled device time on a
             simulated stream: it starts at max(its enqueue start, the previous step's device
             end). PendingStep.wait() sleeps until that device end, releasing the GIL as a CUDA
             synchronize does, so the engine thread wins the GIL back behind the event loop
             exactly as it would beside a real GPU.
  instant    engine_overhead.InstantRunner, sleeping --step-ms a step (GIL released): the
             server's own ceiling when the model costs (next to) nothing.
  cuda       the real CudaRunner on a GPU, Llama-3.2-1B preset (or --model DIR) as gpu_pass.sh
             load-mixed serves it (max_model_len 8192, gpu_memory_utilization 0.8); CudaTimeline
             times each step with two CUDA events on the stream, so the table's GPU busy, host
             gap and device ms are measured, not modeled: where the real server's time goes.

Workloads (--workload): mixed is load_server.py --workload mixed (half the streams decode 512
tokens from 64-256-token prompts, the other half send 2,048-4,096-token prompts with 16-32
tokens out back to back; 64 requests, 64 streams by default); uniform is --num-requests streams
of --max-tokens tokens from short text prompts (256 x 128, 64 at once, by default).

The engine is as `tinyvllm serve` builds it by default (server/launch.py build_server): stats on
(/metrics and the 5 s stats line), prefix caching on, async scheduling on (the runner overlaps
steps), max_num_seqs 256, max_num_batched_tokens 8192, max_model_len 8192, and as the measured
H100 run was started (benchmarks/gpu_pass.sh load-mixed): --disable-log-requests (--log-requests
turns request logging on). The model is the `tiny` preset (real Llama 3 tokenizer, vocabulary
128,256) with a 131,072-token max_position_embeddings as Llama-3.2-1B has (the simulated runner
reads no weights), and 120,000 KV blocks: about what 0.8 of an H100's memory holds for 1B's
32 KiB a token. The server's log (uvicorn's access lines included, as serve logs them) goes to
--server-log (default: a temporary file).

The table's columns, over the measured run (the client's warm-up left out):
  out tok/s, ITL p50 / p99   load_server.py's summary (ITL: every stream, per token)
  steps/s, step ms           engine steps (runner launches) a second, and wall / steps
  prefill %                  the share of steps with prompt tokens (eager, prefill-kind)
  GPU busy                   sum of the steps' modeled device times / wall
  host gap ms                the GPU's idle time a step: (wall - device time) / steps
  wake ms                    how late the engine thread returns from wait() after the device
                             end: time.sleep's overshoot plus winning the GIL back
  host ms / cpu ms           wall time from a step's wait() returning to the next step's launch
                             (only steps launched after the previous one was read back), and
                             the engine thread's CPU time in it: the difference is GIL waits
  enqueue ms                 the wall time of launch()'s enqueue (modeled CPU time plus any GIL
                             handed to the event loop meanwhile)
  loop cpu %, engine cpu %   CPU time of the event-loop and engine threads / wall
Below the row: the engine thread's time a step between consecutive points of its loop
(EnginePhases: the runner's launch, enqueue end, wait and wake, engine.step's return, the
outputs' delivery, each command applied), wall and CPU; wall - CPU is time spent waiting for
the GIL (or, on a loaded machine, for a core).

Device-time model (DeviceModel's defaults; the fit, H100 80GB HBM3, Llama-3.2-1B, bf16, per-op
GPU profiles of decode_profile.py, docs/perf-notes.md):
  prefill-kind step (prompt chunks, maybe beside decode rows, which lead the batch):
      0.30 ms + 3.38 us x new tokens                         (the GEMMs, norms, LM head)
      + 0.552 ns x (query token, context token) pairs of the prompt rows, causal:
        q x (c - q) + q (q + 1) / 2 for a chunk of q tokens ending at context c
      + 10.4 ns x context tokens of the decode rows          (attention_decode)
  decode step (a replayed graph):
      0.92 ms + 7.5 us x sequences + 10.4 ns x context tokens
  Fitted to: a 1,984-token prefill 8.1 ms (model 8.09); 2 x 4,096-token prefill 36.8 ms, 24 %
  of it attention (model 37.3, attention 9.3); a 2,048-token mixed step of 64 decode rows at
  context 3,000 and a 1,984-token chunk ending a 4,096-token prompt 12.3 ms, its prefill
  attention 3.4 ms and decode attention 2.0 ms (model 12.6); a batch-64 decode step at context
  3,000 3.4 ms (model 3.40); batch 1 at context ~250 0.94 ms a token (model 0.93). The load's
  typical step, ~3,800 prompt tokens (~1.2 prompts of ~3,070) beside 64 decode rows (32 at
  context ~400, 32 at ~3,100), comes to ~17.5 ms (the estimate from the profiles: ~17).
  --device-scale multiplies every device time; --launch-us / --launches / --graph-enqueue-ms set
  the enqueue model (--launch-us 0 --graph-enqueue-ms 0: enqueues cost nothing).

Host speed: the engine's own Python runs at this CPU's speed; the enqueue times are the H100
host's. Bounded: loopback only, a fixed number of requests, --timeout seconds.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import io
import json
import logging
import logging.config
import os
import pstats
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))          # this checkout's tinyvllm
sys.path.insert(0, str(HERE))

from engine_overhead import InstantRunner, model_dir, next_tokens  # noqa: E402

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch  # noqa: E402
from tinyvllm.engine.model_runner import ModelRunner, PendingStep, with_mask_resolved  # noqa: E402

H100_KV_BLOCKS = 120_000        # ~0.8 x 80 GB less weights and arena, at 16 x 32 KiB a block
MAX_MODEL_LEN = 8192            # as gpu_pass.sh load-mixed serves


# ---- the simulated GPU ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceModel:
    """How long a step takes on the simulated device and to enqueue (module docstring: the fit)."""
    prefill_fixed_ms: float = 0.30
    prefill_token_us: float = 3.38      # a new token of a prefill-kind step
    attention_pair_ns: float = 0.552    # a (query token, context token) pair of a prompt row
    context_token_ns: float = 10.4      # a context token of a decode row (decode attention)
    decode_fixed_ms: float = 0.92
    decode_seq_us: float = 7.5
    device_scale: float = 1.0           # multiplies every device time
    launch_us: float = 19.0             # host time of one eager launch (prefill-kind steps) ...
    launches: int = 180                 # ... and how many such a step makes
    graph_enqueue_ms: float = 0.1       # host time of a decode step's graph replay

    def device_s(self, batch: ForwardBatch) -> float:
        q = np.diff(batch.query_start).astype(np.int64)
        c = batch.context_lens.astype(np.int64)
        if not batch.is_prefill:
            ms = (self.decode_fixed_ms + 1e-3 * self.decode_seq_us * len(c)
                  + 1e-6 * self.context_token_ns * int(c.sum()))
            return 1e-3 * ms * self.device_scale
        decode_rows = batch.leading_decode_rows
        qp, cp = q[decode_rows:], c[decode_rows:]
        pairs = int((qp * (cp - qp) + qp * (qp + 1) // 2).sum())
        ms = (self.prefill_fixed_ms + 1e-3 * self.prefill_token_us * int(q.sum())
              + 1e-6 * self.attention_pair_ns * pairs
              + 1e-6 * self.context_token_ns * int(c[:decode_rows].sum()))
        return 1e-3 * ms * self.device_scale

    def enqueue_s(self, batch: ForwardBatch) -> float:
        if batch.is_prefill:
            return 1e-6 * self.launch_us * self.launches
        return 1e-3 * self.graph_enqueue_ms


def burn(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time in Python bytecode, holding the GIL as a Python
    launch loop does (another thread can take it only at the interpreter's switch points)."""
    if seconds <= 0:
        return
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@dataclass
class StepRecord:
    """One launched step on the simulated timeline (perf_counter seconds; thread CPU seconds)."""
    is_prefill: bool
    num_seqs: int
    num_tokens: int
    enqueue_start: float
    enqueue_end: float
    device_start: float
    device_end: float
    device_s: float
    cpu_at_launch: float                 # the launching thread's CPU clock at enqueue_start
    wait_called: float | None = None     # when wait() was first called ...
    woke: float | None = None            # ... and when it returned (GIL held again)
    cpu_at_wake: float | None = None


class SimulatedGpuRunner(ModelRunner):
    """A ModelRunner whose steps run on a simulated CUDA stream (module docstring). Steps finish
    in launch order; a step's fed rows (batch.fed_rows) read the ids of the step launched just
    before it, which are known at its launch; a step's pending token mask is resolved when it is
    waited for or the next step is launched, whichever comes first (as CudaRunner samples it).
    `records` holds every step's StepRecord."""
    overlaps_steps = True

    def __init__(self, model: DeviceModel | None = None, num_kv_blocks: int = H100_KV_BLOCKS,
                 gil_releases: int = 0, clock=time.perf_counter, sleep=time.sleep):
        self.model = model or DeviceModel()
        self.num_kv_blocks = num_kv_blocks
        # calls a launch makes that let go of the GIL for a moment (time.sleep(0) each), as the
        # CUDA runner's PyCUDA calls in _stage_inputs do (an event synchronize, an async copy):
        # another busy thread then keeps the GIL for up to the switch interval
        self.gil_releases = gil_releases
        self.mark = None        # an EnginePhases.mark, called at the launch, enqueue end, wait and wake
        self.clock, self.sleep = clock, sleep
        self.stream_end = 0.0                   # when the last step launched ends on the device
        self.records: list[StepRecord] = []
        self._previous_ids: np.ndarray | None = None
        self._unsampled: SamplingBatch | None = None   # the last step's inputs, its mask maybe pending

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        return self.launch(batch, sampling).wait()

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch) -> PendingStep:
        if self._unsampled is not None:      # the step before samples before this one starts
            with_mask_resolved(self._unsampled)
            self._unsampled = None
        if batch.fed_rows is not None:
            if self._previous_ids is None:
                raise ValueError("a step with fed tokens needs a step launched before it")
            batch = batch.with_fed_ids(self._previous_ids)
        tokens = next_tokens(batch)
        if self.mark:
            self.mark("launch")
        start, cpu = self.clock(), time.thread_time()
        for _ in range(self.gil_releases):
            time.sleep(0)
        burn(self.model.enqueue_s(batch))
        enqueued = self.clock()
        if self.mark:
            self.mark("enqueued")
        device_s = self.model.device_s(batch)
        device_start = max(start, self.stream_end)
        # the device cannot finish before its last launch is in
        device_end = max(device_start + device_s, enqueued)
        self.stream_end = device_end
        record = StepRecord(batch.is_prefill, batch.num_seqs, batch.num_tokens, start, enqueued,
                            device_start, device_end, device_s, cpu)
        self.records.append(record)
        self._previous_ids, self._unsampled = tokens, sampling
        self.last_logprobs = None

        def finish() -> np.ndarray:
            if self.mark:
                self.mark("wait")
            record.wait_called = now = self.clock()
            if device_end > now:
                self.sleep(device_end - now)     # releases the GIL, as a CUDA synchronize does
            record.woke, record.cpu_at_wake = self.clock(), time.thread_time()
            if self.mark:
                self.mark("woke")
            with_mask_resolved(sampling)         # a pending mask is resolved by the time it samples
            if self._unsampled is sampling:
                self._unsampled = None
            return tokens
        self._previous = step = PendingStep(finish)
        return step


class SleepyRunner(InstantRunner):
    """InstantRunner that also sleeps `step_s` per step (GIL released, like a GPU wait)."""

    def __init__(self, step_s: float):
        super().__init__()
        self.step_s = step_s

    def execute(self, batch, sampling):
        if self.step_s:
            time.sleep(self.step_s)
        return super().execute(batch, sampling)


class CudaTimeline:
    """--runner cuda: the real CudaRunner's steps as StepRecords, timed on the device. Each launch
    is bracketed by two CUDA events on the runner's stream (the first completes when the stream
    reaches the step: after the step before, or at its enqueue if the stream was idle), its
    wait() by host clocks; EnginePhases marks the launch, enqueue end, wait and wake as the
    simulated runner does. Event times become perf_counter times through one reference event
    recorded on the idle stream after the run."""

    def __init__(self, runner, mark=None):
        import pycuda.driver as cuda
        self.cuda, self.runner, self.mark = cuda, runner, mark
        self.steps: list[tuple[StepRecord, object, object]] = []
        launch = runner.launch

        def timed_launch(batch: ForwardBatch, sampling: SamplingBatch, *a, **kw) -> PendingStep:
            with runner.device.active():
                start = cuda.Event()
                if self.mark:
                    self.mark("launch")
                t0, cpu = time.perf_counter(), time.thread_time()
                start.record(runner.stream)
                pending = launch(batch, sampling, *a, **kw)
                end = cuda.Event()
                end.record(runner.stream)
            t1 = time.perf_counter()
            if self.mark:
                self.mark("enqueued")
            record = StepRecord(batch.is_prefill, batch.num_seqs, batch.num_tokens, t0, t1, 0.0, 0.0, 0.0, cpu)
            self.steps.append((record, start, end))
            finish = pending._finish

            def timed_finish():
                if self.mark:
                    self.mark("wait")
                record.wait_called = time.perf_counter()
                tokens = finish()
                record.woke, record.cpu_at_wake = time.perf_counter(), time.thread_time()
                if self.mark:
                    self.mark("woke")
                return tokens
            if finish is not None:
                pending._finish = timed_finish
            return pending
        runner.launch = timed_launch

    @property
    def records(self) -> list[StepRecord]:
        """Every step so far with its device start, end and time filled in (synchronizes)."""
        with self.runner.device.active():
            ref = self.cuda.Event()
            ref.record(self.runner.stream)
            ref.synchronize()
            now = time.perf_counter()
            for record, start, end in self.steps:
                record.device_start = now - start.time_till(ref) / 1e3
                record.device_end = now - end.time_till(ref) / 1e3
                record.device_s = record.device_end - record.device_start
        return [r for r, _, _ in self.steps]


def long_context_model_dir() -> Path:
    """The `tiny` preset (engine_overhead.model_dir) with Llama-3.2-1B's max_position_embeddings
    (131,072): the mixed load's 4,096-token prompts need more than the preset's 4,096. The other
    files are links to the preset's."""
    base = model_dir()
    out = base.parent / "tiny-long-context"
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            if f.name != "config.json" and not (out / f.name).exists():
                (out / f.name).symlink_to(f)
        config = json.loads((base / "config.json").read_text())
        config["max_position_embeddings"] = 131072
        tmp = out / "config.json.tmp"
        tmp.write_text(json.dumps(config, indent=1))
        tmp.replace(out / "config.json")
    return out


def cuda_model_dir(model: str | None) -> Path:
    """--runner cuda's model: `model`, or the Llama-3.2-1B preset the GPU load runs serve."""
    if model:
        return Path(model)
    out = Path("/tmp/tinyvllm-models/llama-3.2-1b")
    if not (out / "config.json").is_file():
        from tinyvllm.checkpoint.model_writer import write_model
        write_model(out, preset="llama-3.2-1b", seed=0)
    return out


# ---- what the run measured -----------------------------------------------------------------------

def timeline_stats(records: list[StepRecord]) -> dict:
    """The simulated GPU's figures over `records` (consecutive steps): wall from the first
    enqueue to the last device end, device time, and the per-step means of the table."""
    if not records:
        return {}
    wall = records[-1].device_end - records[0].enqueue_start
    busy = sum(r.device_s for r in records)
    sequential = [(a, b) for a, b in zip(records, records[1:])
                  if a.woke is not None and a.woke <= b.enqueue_start]
    woken = [r for r in records if r.woke is not None and r.wait_called is not None]
    mean = lambda xs: statistics.fmean(xs) if xs else float("nan")     # noqa: E731
    return {
        "steps": len(records), "wall_s": wall, "device_s": busy,
        "prefill_steps": sum(r.is_prefill for r in records),
        "steps_per_s": len(records) / wall, "step_ms": 1e3 * wall / len(records),
        "gpu_busy": busy / wall, "host_gap_ms": 1e3 * (wall - busy) / len(records),
        "device_ms": 1e3 * busy / len(records),
        "prefill_device_ms": 1e3 * mean([r.device_s for r in records if r.is_prefill]),
        "decode_device_ms": 1e3 * mean([r.device_s for r in records if not r.is_prefill]),
        "prefill_tokens": mean([r.num_tokens for r in records if r.is_prefill]),
        "seqs": mean([r.num_seqs for r in records]),
        "wake_ms": 1e3 * mean([r.woke - max(r.device_end, r.wait_called) for r in woken]),
        "waited_ms": 1e3 * mean([max(r.device_end - r.wait_called, 0.0) for r in woken]),
        "host_ms": 1e3 * mean([b.enqueue_start - a.woke for a, b in sequential]),
        "host_cpu_ms": 1e3 * mean([b.cpu_at_launch - a.cpu_at_wake for a, b in sequential]),
        "sequential_share": len(sequential) / max(len(records) - 1, 1),
        "enqueue_ms": 1e3 * mean([r.enqueue_end - r.enqueue_start for r in records]),
        "prefill_enqueue_ms": 1e3 * mean([r.enqueue_end - r.enqueue_start for r in records if r.is_prefill]),
    }


class EnginePhases:
    """Where the engine thread's time goes: mark(name) notes (name, wall, thread CPU) at points
    of the engine loop (wrapped around EngineLoop's engine.step, _deliver and _apply, and the
    runner's launch and wait); the time between two consecutive marks is booked to the pair
    "a -> b", so that the buckets sum to the thread's whole time, wall and CPU (wall - CPU: the
    thread was waiting, for the GIL or in a sleep)."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] = []
        self.recording = False

    def mark(self, name: str) -> None:
        if self.recording:
            self.events.append((name, time.perf_counter(), time.thread_time()))

    def install(self, engine_loop) -> None:
        """Wrap engine_loop's step, _deliver and _apply (instance attributes, this loop only)."""
        engine, mark = engine_loop.engine, self.mark
        step, deliver, apply = engine.step, engine_loop._deliver, engine_loop._apply

        def timed_step(**kw):
            outputs = step(**kw)
            mark("step returned")
            return outputs

        def timed_deliver(deliveries):
            mark("deliver")
            deliver(deliveries)
            mark("delivered")

        def timed_apply(command):
            mark("command")
            apply(command)
            mark("command applied")
        engine.step, engine_loop._deliver, engine_loop._apply = timed_step, timed_deliver, timed_apply

    def buckets(self) -> dict[str, tuple[int, float, float]]:
        """"a -> b": (times, wall seconds, CPU seconds), in the order first seen."""
        out: dict[str, list] = {}
        for (a, wall_a, cpu_a), (b, wall_b, cpu_b) in zip(self.events, self.events[1:]):
            bucket = out.setdefault(f"{a} -> {b}", [0, 0.0, 0.0])
            bucket[0] += 1
            bucket[1] += wall_b - wall_a
            bucket[2] += cpu_b - cpu_a
        return {k: tuple(v) for k, v in out.items()}

    def table(self, steps: int) -> str:
        """The buckets as ms a step (wall, CPU, wall - CPU), largest wall first."""
        rows = sorted(self.buckets().items(), key=lambda kv: -kv[1][1])
        lines = [f"engine thread, ms a step over {steps} steps: {'wall':>7} {'cpu':>7} {'waiting':>7}  times  interval"]
        for name, (n, wall, cpu) in rows:
            lines.append(f"{'':<46}{1e3 * wall / steps:7.2f} {1e3 * cpu / steps:7.2f} "
                         f"{1e3 * (wall - cpu) / steps:7.2f} {n:6d}  {name}")
        return "\n".join(lines)


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds `thread` (of this process, running) has used so far."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class ThreadProfile:
    """Wraps a thread's target: cProfile inside that thread only, when asked."""

    def __init__(self, enabled: bool):
        self.profile = cProfile.Profile() if enabled else None

    def wrap(self, fn):
        def run(*a, **kw):
            if self.profile:
                self.profile.enable()
            try:
                return fn(*a, **kw)
            finally:
                if self.profile:
                    self.profile.disable()
        return run

    def report(self, name: str, top: int) -> str:
        if self.profile is None:
            return ""
        out = []
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(self.profile, stream=s).sort_stats(key).print_stats(top)
            out.append(f"\n== cProfile: {name}, by {key} ==\n{s.getvalue()}")
        return "".join(out)


def logging_config(path: str) -> dict:
    """uvicorn's logging config with its lines, and tinyvllm's, written to `path` (serve's levels:
    INFO, access lines on)."""
    import uvicorn.config
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for name in ("default", "access"):
        config["handlers"][name] = {"class": "logging.FileHandler", "filename": path,
                                    "formatter": name}
    config["formatters"]["default"]["use_colors"] = False
    config["formatters"]["access"]["use_colors"] = False
    config["loggers"]["tinyvllm"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


# ---- one run -------------------------------------------------------------------------------------

@dataclass
class RunResult:
    label: str
    load: dict = field(default_factory=dict)         # load_server.py's summary
    timeline: dict = field(default_factory=dict)     # timeline_stats over the measured steps
    loop_cpu: float = 0.0
    engine_cpu: float = 0.0
    wall_s: float = 0.0
    client_cpu: float = 0.0
    returncode: int = 0
    phases: str = ""                                 # EnginePhases.table


def serve_and_load(args) -> tuple[RunResult, str]:
    """Start the server in this process, run the load against it, stop it. -> (result, the
    profiles' text, empty without --profile)."""
    import uvicorn

    from tinyvllm.server.launch import ServeOptions, build_server

    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    log_path = args.server_log or os.path.join(tempfile.mkdtemp(prefix="server-overhead-"), "server.log")
    logging.config.dictConfig(logging_config(log_path))
    runner = None
    if args.runner == "simulated":
        runner = SimulatedGpuRunner(DeviceModel(device_scale=args.device_scale, launch_us=args.launch_us,
                                                launches=args.launches,
                                                graph_enqueue_ms=args.graph_enqueue_ms),
                                    args.num_kv_blocks, args.gil_releases)
        model = long_context_model_dir()
    elif args.runner == "cuda":
        model = cuda_model_dir(args.model)
    else:
        runner, model = SleepyRunner(args.step_ms / 1e3), model_dir()
    engine_options = {"runner": runner, "device": "cuda" if args.runner == "cuda" else "cpu",
                      "max_num_seqs": args.max_num_seqs,
                      "max_num_batched_tokens": args.max_num_batched_tokens,
                      "enable_prefix_caching": not args.no_prefix_caching}
    if args.runner in ("simulated", "cuda"):
        engine_options["max_model_len"] = MAX_MODEL_LEN
    if args.runner == "cuda":
        engine_options["gpu_memory_utilization"] = 0.8       # as gpu_pass.sh load-mixed serves
    if args.no_async_scheduling:
        engine_options["async_scheduling"] = False
    app, engine_loop = build_server(ServeOptions(
        model=str(model), served_model_names=("tiny",), engine_options=engine_options,
        log_requests=args.log_requests, log_stats=not args.no_stats))
    phases = EnginePhases()
    phases.install(engine_loop)
    if args.runner == "simulated":
        runner.mark = phases.mark
    elif args.runner == "cuda":
        runner = CudaTimeline(engine_loop.engine.runner, phases.mark)
    engine_profile = ThreadProfile(args.profile in ("both", "engine"))
    loop_profile = ThreadProfile(args.profile in ("both", "loop"))
    engine_loop._thread._target = engine_profile.wrap(engine_loop._thread._target)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_config=logging_config(log_path), log_level="info"))
    loop_thread = threading.Thread(target=loop_profile.wrap(server.run), kwargs={"sockets": [sock]},
                                   name="event-loop", daemon=True)
    loop_thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not loop_thread.is_alive() or time.monotonic() > deadline:
            sys.exit("server did not start")
        time.sleep(0.01)
    warm_up(url)

    scrapes, stop_scraping = [], threading.Event()

    def scrape():
        while not stop_scraping.wait(args.scrape_s):
            start = time.perf_counter()
            body = urllib.request.urlopen(url + "/metrics", timeout=10).read()
            scrapes.append((time.perf_counter() - start, len(body)))

    if args.scrape_s > 0:
        threading.Thread(target=scrape, daemon=True).start()
    result = RunResult(label=args.label)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or os.path.join(tmp, "load.json")
        profile_client = ["-m", "cProfile", "-s", "tottime"] if args.profile_client else []
        cmd = [sys.executable, *profile_client, str(HERE / "load_server.py"), "--url", url,
               "--workload", args.workload, "--num-requests", str(args.num_requests),
               "--concurrency", str(args.concurrency), "--timeout", str(args.timeout),
               "--warmup", "0", "--out", out]
        if args.workload == "uniform":
            cmd += ["--max-tokens", str(args.max_tokens), "--client-procs", str(args.client_procs)]
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        first_step = len(getattr(runner, "records", ()))
        engine_thread = engine_loop._thread
        cpu0, start = (thread_cpu(loop_thread), thread_cpu(engine_thread)), time.perf_counter()
        phases.recording = True
        try:
            proc = subprocess.run(cmd, timeout=args.timeout + 60, capture_output=True, text=True)
        finally:
            phases.recording = False
            result.wall_s = time.perf_counter() - start
            result.loop_cpu = thread_cpu(loop_thread) - cpu0[0]
            result.engine_cpu = thread_cpu(engine_thread) - cpu0[1]
            stop_scraping.set()
            server.should_exit = True
            loop_thread.join(30)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result.client_cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
        if args.verbose or proc.returncode != 0:
            print(proc.stdout if not args.profile_client
                  else "\n".join(proc.stdout.splitlines()[:30 + args.top]), file=sys.stderr)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
        result.returncode = proc.returncode
        result.load = json.load(open(out)).get("summary", {}) if os.path.exists(out) else {}
    if args.runner in ("simulated", "cuda"):
        records = runner.records[first_step:]
        result.timeline = timeline_stats(records)
        if args.steps_out:
            with open(args.steps_out, "w") as f:
                json.dump([dataclasses.asdict(r) for r in records], f)
        result.phases = phases.table(max(len(runner.records) - first_step, 1))
    if scrapes:
        print(f"{len(scrapes)} scrapes of /metrics, {statistics.mean(s for s, _ in scrapes) * 1e3:.1f} ms "
              f"each on average, {scrapes[-1][1]:,} bytes", file=sys.stderr)
    print(f"server log: {log_path}", file=sys.stderr)
    profiles = ""
    if args.profile:
        profiles = (engine_profile.report("engine thread", args.top)
                    + loop_profile.report("event loop thread", args.top))   # "" for a thread not profiled
    return result, profiles


def warm_up(url: str) -> None:
    """One small completion, streamed, before anything is measured (first-call imports and the
    like); the measured client then sends no warm-up of its own."""
    body = json.dumps({"model": "tiny", "prompt": [1000, 2000, 3000], "max_tokens": 4,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


# ---- the table -----------------------------------------------------------------------------------

COLUMNS = ["run", "out tok/s", "ITL p50/p99 ms", "steps/s", "step ms", "prefill %", "GPU busy",
           "host gap ms", "wake ms", "host ms / cpu ms", "enqueue ms", "loop cpu %", "engine cpu %"]


def table_row(r: RunResult) -> list[str]:
    s, t = r.load, r.timeline
    itl = s.get("itl_ms") or {}
    f = lambda key, fmt="{:.2f}": fmt.format(t[key]) if key in t else "-"     # noqa: E731
    return [r.label, f"{s.get('output_tokens_per_s', 0):,.0f}", f"{itl.get('p50')} / {itl.get('p99')}",
            f("steps_per_s", "{:.1f}"), f("step_ms"),
            f"{100 * t['prefill_steps'] / t['steps']:.0f}" if t else "-",
            f"{100 * t['gpu_busy']:.0f} %" if t else "-", f("host_gap_ms"), f("wake_ms"),
            f"{t['host_ms']:.2f} / {t['host_cpu_ms']:.2f}" if t else "-", f("enqueue_ms"),
            f"{100 * r.loop_cpu / r.wall_s:.0f}", f"{100 * r.engine_cpu / r.wall_s:.0f}"]


def print_table(rows: list[RunResult]) -> None:
    cells = [table_row(r) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(COLUMNS)]
    line = lambda cs: "| " + " | ".join(c.rjust(w) for c, w in zip(cs, widths)) + " |"   # noqa: E731
    print(line(COLUMNS))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells:
        print(line(c))


def print_details(r: RunResult) -> None:
    t, s = r.timeline, r.load
    if t:
        print(f"{t['steps']} steps in {t['wall_s']:.1f} s ({t['prefill_steps']} prefill-kind, "
              f"{t['prefill_tokens']:.0f} new tokens each on average; {t['seqs']:.0f} sequences a step); "
              f"device ms a step: {t['device_ms']:.2f} (prefill-kind {t['prefill_device_ms']:.2f}, "
              f"decode {t['decode_device_ms']:.2f}); wait() found the device busy for {t['waited_ms']:.2f} ms "
              f"on average; {100 * t['sequential_share']:.0f} % of steps launched after the previous "
              f"one was read back; prefill-kind enqueue {t['prefill_enqueue_ms']:.2f} ms wall")
    classes = s.get("classes") or {}
    for kind, c in classes.items():
        print(f"{kind}: {c['succeeded']} ok, {c['output_tokens']:,} tokens, TTFT p50/p99 "
              f"{c['ttft_ms']['p50']} / {c['ttft_ms']['p99']} ms, ITL p50/p99 {c['itl_ms']['p50']} / "
              f"{c['itl_ms']['p99']} ms")
    print(f"server CPU s: event loop {r.loop_cpu:.2f}, engine thread {r.engine_cpu:.2f} over "
          f"{r.wall_s:.1f} s; client process {r.client_cpu:.2f}")
    if r.phases:
        print(r.phases)


def describe(args) -> str:
    """A short label of the settings that differ from the defaults."""
    parts = [f"{k.replace('_', '-')}={v}" for k, v in sorted(vars(args).items())
             if k in TABLE_FLAGS and v != DEFAULTS.get(k)]
    return ", ".join(parts) or "default"


# settings a row's label names when they differ from the defaults
TABLE_FLAGS = ("runner", "workload", "step_ms", "max_num_batched_tokens", "max_num_seqs",
               "no_stats", "no_prefix_caching", "no_async_scheduling", "device_scale", "launch_us",
               "launches", "graph_enqueue_ms", "gil_releases", "switch_interval_ms", "log_requests", "num_requests",
               "concurrency", "max_tokens")

# --sweep: one run (a child process each) per line, the flags after the default's
SWEEP = [
    [],
    ["--max-num-batched-tokens", "2048"],
    ["--launch-us", "0", "--graph-enqueue-ms", "0"],
    ["--no-stats"],
    ["--switch-interval-ms", "0.5"],
    ["--gil-releases", "2"],
    ["--device-scale", "0"],
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", choices=["simulated", "instant", "cuda"], default="simulated")
    ap.add_argument("--model", default=None,
                    help="--runner cuda: the model directory (default: the llama-3.2-1b preset, made in "
                         "/tmp/tinyvllm-models if absent)")
    ap.add_argument("--workload", choices=["mixed", "uniform"], default="mixed")
    ap.add_argument("--num-requests", type=int, default=None, help="default: 64 mixed, 256 uniform")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128, help="uniform: tokens a request")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=H100_KV_BLOCKS, help="simulated runner's KV cache")
    ap.add_argument("--no-stats", action="store_true",
                    help="as serve --disable-log-stats: no StepStats, no /metrics")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--log-requests", action="store_true", help="log every request, as serve does by default")
    ap.add_argument("--device-scale", type=float, default=1.0, help="multiply every modeled device time")
    ap.add_argument("--launch-us", type=float, default=DeviceModel.launch_us,
                    help="host time of one eager launch of a prefill-kind step")
    ap.add_argument("--launches", type=int, default=DeviceModel.launches,
                    help="eager launches of a prefill-kind step")
    ap.add_argument("--graph-enqueue-ms", type=float, default=DeviceModel.graph_enqueue_ms,
                    help="host time of a decode step's graph launch")
    ap.add_argument("--gil-releases", type=int, default=0,
                    help="GIL-releasing calls a launch makes (time.sleep(0) each; the CUDA runner's "
                         "_stage_inputs makes 2 through PyCUDA, the launches through CDLL made ~180)")
    ap.add_argument("--switch-interval-ms", type=float, default=0.0,
                    help="sys.setswitchinterval for the server process (0: Python's 5 ms)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="--runner instant: sleep per step")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--profile", nargs="?", const="both", choices=["both", "engine", "loop"], default=None,
                    help="cProfile the engine thread, the event loop thread or both (top --top each, by "
                         "cumulative and by own time); slows them. Python 3.12+ runs one cProfile at a time "
                         "in a process, so there: engine or loop")
    ap.add_argument("--profile-client", action="store_true", help="cProfile the load client too")
    ap.add_argument("--client-procs", type=int, default=1, help="uniform: load_server.py --client-procs")
    ap.add_argument("--top", type=int, default=25, help="rows of each profile to print")
    ap.add_argument("--scrape-s", type=float, default=0.0,
                    help="GET /metrics this often during the run, as Prometheus would (0: never)")
    ap.add_argument("--out", default=None, help="write load_server.py's JSON here")
    ap.add_argument("--server-log", default=None, help="the server's log file (default: a temporary one)")
    ap.add_argument("--label", default=None, help="the row's name in the table")
    ap.add_argument("--json", default=None, help="write this run's row (RunResult) as JSON here")
    ap.add_argument("--steps-out", default=None, help="write every measured step's StepRecord as JSON here")
    ap.add_argument("--sweep", action="store_true",
                    help="run the default and each variant of SWEEP in a child process; one table")
    ap.add_argument("--variant", action="append", default=[], metavar="FLAGS",
                    help="run these flags as a row, in a child process; repeat for an A/B: "
                         "--variant= --variant=--no-stats (an empty one is the default)")
    ap.add_argument("--rounds", type=int, default=1, help="--sweep / --variant: times over the list")
    ap.add_argument("--verbose", action="store_true", help="print load_server.py's own table too")
    return ap


def strip_sweep_flags(argv: list[str]) -> list[str]:
    """argv without --sweep, --variant X and --rounds N (what each child gets besides its variant)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--sweep":
            continue
        elif a in ("--variant", "--rounds"):
            skip = True
        elif not a.startswith(("--variant=", "--rounds=")):
            out.append(a)
    return out


DEFAULTS = {a.dest: a.default for a in build_parser()._actions}


def sweep(argv: list[str], variants: list[list[str]], rounds: int) -> int:
    """Each variant (flags after `argv`'s) in a child process, the list `rounds` times over
    (alternating, so that drift hits every variant alike); then one table."""
    rows, status = [], 0
    for _ in range(rounds):
        for variant in variants:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "row.json")
                cmd = [sys.executable, __file__, *argv, *variant, "--json", path]
                print("running:", " ".join(cmd[2:]), file=sys.stderr, flush=True)
                rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
                status = status or rc
                if os.path.exists(path):
                    rows.append(RunResult(**json.load(open(path))))
    print_table(rows)
    return status


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.profile == "both" and sys.version_info >= (3, 12):
        parser.error("--profile both: Python 3.12+ runs one cProfile at a time in a process "
                     "(a second one fails with 'Another profiling tool is already active'); "
                     "use --profile engine or --profile loop")
    if args.sweep or args.variant:
        base = strip_sweep_flags(argv)
        variants = [v.split() for v in args.variant] if args.variant else SWEEP
        return sweep(base, variants, args.rounds)
    args.label = args.label or describe(args)
    if args.num_requests is None:
        args.num_requests = 64 if args.workload == "mixed" else 256
    result, profiles = serve_and_load(args)
    print_table([result])
    print_details(result)
    print(profiles, end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(vars(result), f)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
