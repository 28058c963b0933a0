"""The bench's side of `tinyvllm bench --compare-vllm`: the same workloads with vLLM's offline `LLM`.

vLLM runs in a child process (bench/vllm_child.py), started after tinyvllm's engines have closed:
each engine takes most of the GPU's memory, and the child keeps vLLM's imports and environment
(VLLM_USE_FLASHINFER_SAMPLER=0; the sampler's FlashInfer path is not needed for greedy decoding)
out of the bench's process. vLLM is found on the child's PYTHONPATH, with --vllm-site DIR in
front when given; it is not a tinyvllm dependency.

The child gets every request as token ids (so both engines run the same ones) and vLLM's own
defaults for the card except: dtype bfloat16, gpu_memory_utilization 0.8 (tinyvllm's process
still holds its CUDA context) and max_model_len 4096 or the longest context the workloads need.
It reports raw wall times, turned into results here:
  latency     TTFT = the wall time of the request with max_tokens=1; decode tok/s =
              (n - 1) / (t_n - t_1), medians over the repeats (the way bench/hf.py measures HF).
  the others  output tok/s = generated tokens / the generate call's wall time (prefix: one run,
              with vLLM's prefix caching as it defaults, on).
A child that fails or overruns --vllm-max-seconds leaves what it finished; the workloads it did not
finish are reported with a note instead of numbers.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import tinyvllm
from tinyvllm.bench.workloads import WARMUP, BenchRequest, WorkloadResult, WorkloadSpec, shrink
from tinyvllm.errors import TinyVLLMError

CHILD_MODULE = "tinyvllm.bench.vllm_child"
LLM_OPTIONS = {"dtype": "bfloat16", "gpu_memory_utilization": 0.8}
MIN_MAX_MODEL_LEN = 4096
PACKAGE_ROOT = Path(tinyvllm.__file__).resolve().parent.parent     # what `-m tinyvllm...` needs


def child_env(site: str | None) -> dict:
    """The child's environment: PYTHONPATH = [--vllm-site], this tinyvllm, then the caller's."""
    env = dict(os.environ)
    paths = [str(Path(site).resolve())] if site else []
    paths += [str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def check_available(site: str | None) -> None:
    """Fails in one line, before any tinyvllm run, when the child would find no vLLM."""
    if site is not None and not Path(site).is_dir():
        raise TinyVLLMError(f"--vllm-site {site}: no such directory")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    found = subprocess.run([sys.executable, "-c", probe], env=child_env(site), capture_output=True).returncode == 0
    if not found:
        where = f"in --vllm-site {site} or on PYTHONPATH" if site else "on PYTHONPATH"
        raise TinyVLLMError(f"--compare-vllm: vLLM is not importable {where} (it is not a tinyvllm "
                            f"dependency); pass --vllm-site DIR, the directory vLLM is installed in")


def child_command() -> list[str]:
    """As a module, not a file path: a script's own folder would come first on sys.path, and this
    module's name would shadow vLLM's there."""
    return [sys.executable, "-m", CHILD_MODULE]


def make_job(model_dir: Path, specs: list[WorkloadSpec], seed: int, max_len: int | None) -> dict:
    """What the child runs: the model, vLLM's options, the warm-up and the workloads' requests."""
    as_lists = lambda requests: [[r.prompt_token_ids, r.max_tokens] for r in requests]  # noqa: E731
    warmup = [shrink(spec, max_len=max_len) for spec in WARMUP]
    longest = max(s.max_context for s in [*specs, *warmup])
    return {"model": str(model_dir),
            "llm_options": {**LLM_OPTIONS, "max_model_len": max(MIN_MAX_MODEL_LEN, longest)},
            "warmup": [as_lists(spec.requests(seed)) for spec in warmup],
            "workloads": [{"name": spec.name, "repeats": spec.repeats, "single": spec.num_requests == 1,
                           "requests": as_lists(spec.requests(seed))} for spec in specs]}


def result_from_timings(spec: WorkloadSpec, requests: list[BenchRequest], timings: dict | None,
                        note: str) -> WorkloadResult:
    """A WorkloadResult from the child's wall times (None: the workload did not finish; `note`
    says why)."""
    result = WorkloadResult("vllm", num_requests=len(requests),
                            prompt_tokens=sum(len(r.prompt_token_ids) for r in requests))
    if not timings or not timings["walls"]:
        result.note = note
        return result
    result.output_tokens = timings["output_tokens"]
    wall = statistics.median(timings["walls"])
    if spec.num_requests == 1 and timings["first_token_walls"]:
        first = statistics.median(timings["first_token_walls"])
        result.ttft_ms = 1000 * first
        n = requests[0].max_tokens
        result.decode_tok_s = (n - 1) / (wall - first) if n > 1 and wall > first else None
    return result.finish(wall)


def run_child(command: list[str], env: dict, max_seconds: float, out=None) -> tuple[int | None, str]:
    """Run the child in a session of its own, its output passed on to `out` (stderr) as it comes.
    -> (exit status, None when it was stopped at max_seconds; its last line of output). Whatever
    the child started (vLLM's engine process) is stopped with it, so that it neither keeps the
    GPU nor holds the output pipe open."""
    out = out or sys.stderr
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    tail = collections.deque(maxlen=1)

    def pass_on():
        for line in proc.stdout:
            out.write(line)
            if line.strip():
                tail.append(line.strip())
    reader = threading.Thread(target=pass_on, daemon=True)
    reader.start()
    try:
        status = proc.wait(timeout=max_seconds)
    except subprocess.TimeoutExpired:
        status = None
    finally:
        kill_session(proc.pid)
        proc.wait()
    reader.join(timeout=10)
    return status, (tail[0] if tail else "")


def kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass                                   # the session has ended already


def run_vllm_workloads(model_dir: Path, specs: list[WorkloadSpec], seed: int, max_len: int | None,
                       site: str | None, max_seconds: float) -> tuple[dict, dict]:
    """-> ({workload: result}, what ran them: versions, LLM options, engine start-up seconds)."""
    job = make_job(model_dir, specs, seed, max_len)
    env = child_env(site)
    with tempfile.TemporaryDirectory(prefix="tinyvllm-bench-vllm-") as tmp:
        job_path, results_path = Path(tmp) / "job.json", Path(tmp) / "results.json"
        job_path.write_text(json.dumps(job))
        status, last_line = run_child([*child_command(), str(job_path), str(results_path)], env, max_seconds)
        raw = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if status is None:
        note = f"cut off: --vllm-max-seconds {max_seconds:g} ran out"
    elif status:
        note = f"failed: the vLLM process exited with status {status}: {last_line[:200]}"
    else:
        note = "failed: the vLLM process reported no result"
    if status != 0:
        print(f"vLLM: {note}", file=sys.stderr)
    timings = raw.get("workloads", {})
    results = {spec.name: result_from_timings(spec, spec.requests(seed), timings.get(spec.name), note)
               for spec in specs}
    about = {**raw.get("versions", {}), "llm_options": job["llm_options"], "engine_start_s": raw.get("engine_start_s"),
             "max_seconds": max_seconds, "VLLM_USE_FLASHINFER_SAMPLER": env["VLLM_USE_FLASHINFER_SAMPLER"]}
    return results, about
