#!/usr/bin/env python3
"""The server's own ceiling: the real app, EngineLoop and LLMEngine, with the model taken out.

The engine's runner is engine_overhead.InstantRunner (the next token is a hash; optionally it
sleeps --step-ms per step, with the GIL released, as a GPU step would). The app runs under
uvicorn in this process on a free 127.0.0.1 port; load_server.py's client runs in a child
process (so its JSON parsing does not share this process's GIL), and its summary is printed:
what the server can deliver when the model costs nothing.

    python benchmarks/server_overhead.py                         # 256 x 128 tokens, 64 streams
    python benchmarks/server_overhead.py --step-ms 2 --profile   # cProfile both server threads
    python benchmarks/server_overhead.py --scrape-s 1            # and GET /metrics every second

Bounded: loopback only, a fixed number of requests, --timeout seconds. Also printed: CPU
seconds of the event-loop thread and of the engine thread over the run (where the time goes)."""
from __future__ import annotations

import argparse
import cProfile
import io
import json
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))          # this checkout's tinyvllm
sys.path.insert(0, str(HERE))

from engine_overhead import InstantRunner, model_dir  # noqa: E402


class SleepyRunner(InstantRunner):
    """InstantRunner that also sleeps `step_s` per step (GIL released, like a GPU wait)."""

    def __init__(self, step_s: float):
        super().__init__()
        self.step_s = step_s

    def execute(self, batch, sampling):
        if self.step_s:
            time.sleep(self.step_s)
        return super().execute(batch, sampling)


class ThreadTimer:
    """CPU seconds a thread spent between start() and stop() (read inside that thread)."""

    def __init__(self):
        self.cpu = 0.0
        self.profile: cProfile.Profile | None = None

    def wrap(self, fn, profile: bool):
        def run(*a, **kw):
            self.profile = cProfile.Profile() if profile else None
            start = time.thread_time()
            if self.profile:
                self.profile.enable()
            try:
                return fn(*a, **kw)
            finally:
                if self.profile:
                    self.profile.disable()
                self.cpu = time.thread_time() - start
        return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=0.0, help="fake GPU time per engine step")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--profile", action="store_true", help="cProfile the event loop and engine threads")
    ap.add_argument("--profile-client", action="store_true", help="cProfile the load client too")
    ap.add_argument("--client-procs", type=int, default=1, help="load_server.py --client-procs")
    ap.add_argument("--top", type=int, default=25, help="rows of each profile to print")
    ap.add_argument("--out", default=None, help="write the load summary (JSON) here")
    ap.add_argument("--no-stats", action="store_true",
                    help="as serve --disable-log-stats: no StepStats, no /metrics (the A/B baseline)")
    ap.add_argument("--scrape-s", type=float, default=0.0,
                    help="GET /metrics this often during the run, as Prometheus would (0: never)")
    args = ap.parse_args(argv)

    import uvicorn

    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.server.app import ServerSettings, build_app
    from tinyvllm.server.engine_loop import EngineLoop

    engine = LLMEngine(model_dir(), runner=SleepyRunner(args.step_ms / 1000), device="cpu",
                       max_num_seqs=256, max_num_batched_tokens=16384)
    engine_loop = EngineLoop(engine)
    engine_timer, loop_timer = ThreadTimer(), ThreadTimer()
    engine_loop._thread._target = engine_timer.wrap(engine_loop._thread._target, args.profile)
    app = build_app(engine_loop, ServerSettings(model_names=("tiny",), log_stats=not args.no_stats))

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=loop_timer.wrap(server.run, args.profile),
                              kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sys.exit("server did not start")
        time.sleep(0.01)

    scrapes, stop_scraping = [], threading.Event()

    def scrape():
        while not stop_scraping.wait(args.scrape_s):
            start = time.perf_counter()
            body = urllib.request.urlopen(url + "/metrics", timeout=10).read()
            scrapes.append((time.perf_counter() - start, len(body)))

    if args.scrape_s > 0:
        threading.Thread(target=scrape, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or os.path.join(tmp, "load.json")
        profile_client = ["-m", "cProfile", "-s", "tottime"] if args.profile_client else []
        cmd = [sys.executable, *profile_client, str(HERE / "load_server.py"), "--url", url,
               "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
               "--max-tokens", str(args.max_tokens), "--timeout", str(args.timeout),
               "--warmup", "2", "--client-procs", str(args.client_procs), "--out", out]
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            proc = subprocess.run(cmd, timeout=args.timeout + 60, capture_output=True, text=True)
        finally:
            stop_scraping.set()
            server.should_exit = True
            thread.join(30)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        client_cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
        print(proc.stdout if not args.profile_client
              else "\n".join(proc.stdout.splitlines()[:12 + 8 + args.top]))
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
        result = json.load(open(out)) if os.path.exists(out) else {}
        summary = result.get("summary", {})
        measured_cpu = result.get("client", {}).get("cpu_s")

    print(f"step-ms {args.step_ms}; server CPU s: event loop {loop_timer.cpu:.2f}, "
          f"engine thread {engine_timer.cpu:.2f}; client process {client_cpu:.2f} (run {summary.get('duration_s')} s + warm-up)")
    events = summary.get("succeeded", 0) * (args.max_tokens + 2)   # text chunks + final + usage
    if measured_cpu is not None and events:
        print(f"client CPU in the measured run: {measured_cpu:.2f} s over {args.client_procs} "
              f"process(es), {measured_cpu / events * 1e6:.1f} µs per SSE event ({events} events)")
    if scrapes:
        print(f"{len(scrapes)} scrapes of /metrics, {statistics.mean(s for s, _ in scrapes) * 1e3:.1f} ms "
              f"each on average, {scrapes[-1][1]:,} bytes")
    if args.profile:
        for name, timer in (("event loop thread", loop_timer), ("engine thread", engine_timer)):
            s = io.StringIO()
            pstats.Stats(timer.profile, stream=s).sort_stats("tottime").print_stats(args.top)
            print(f"\n== cProfile: {name} ==\n{s.getvalue()}")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
