"""The vLLM side of `tinyvllm bench --compare-vllm`, run in a process of its own by bench/vllm.py:

    python -m tinyvllm.bench.vllm_child JOB.json RESULTS.json

JOB.json holds the model directory, the options of vLLM's offline `LLM`, the warm-up requests and
each workload's requests as token ids (built by the bench, so both engines get the same ones).
Each request runs greedy with ignore_eos, so it generates exactly its max_tokens. Every timed
`generate` starts from an empty prefix cache, as tinyvllm's runs do. A batch-1 workload is timed
twice per repeat, once with max_tokens=1 and once in full, so that the time per token after the
first is the difference of the two (HF's way; vLLM's offline outputs carry no per-token times).

RESULTS.json is rewritten after the engine starts and after each workload, so that a run cut short
still leaves what it measured: {"versions", "engine_start_s", "workloads": {name: {"walls",
"first_token_walls", "output_tokens"}}}. The wall times are raw; bench/vllm.py turns them into
results. vLLM is imported here only, so that neither it nor its environment reaches the bench's
own process; this module needs nothing but the standard library and vLLM.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

MISSING_VLLM = 3                  # exit status when vLLM cannot be imported


def engine_inputs(requests: list, sampling_params, max_tokens: int | None = None) -> tuple[list, list]:
    """[[prompt token ids, max_tokens], ...] -> (vLLM token prompts, one greedy ignore_eos
    SamplingParams each); max_tokens, when given, replaces every request's own."""
    prompts = [{"prompt_token_ids": list(ids)} for ids, _ in requests]
    params = [sampling_params(temperature=0.0, max_tokens=max_tokens or n, ignore_eos=True) for _, n in requests]
    return prompts, params


def timed_generate(llm, sampling_params, requests: list, max_tokens: int | None = None) -> tuple[float, int]:
    """One generate call over all of `requests` from an empty prefix cache -> (seconds, tokens
    generated)."""
    prompts, params = engine_inputs(requests, sampling_params, max_tokens)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return wall, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_workload(llm, sampling_params, workload: dict) -> dict:
    walls, first_token_walls, tokens = [], [], 0
    for _ in range(workload["repeats"]):
        if workload["single"]:
            first_token_walls.append(timed_generate(llm, sampling_params, workload["requests"], 1)[0])
        wall, tokens = timed_generate(llm, sampling_params, workload["requests"])
        walls.append(wall)
    return {"walls": walls, "first_token_walls": first_token_walls, "output_tokens": tokens}


def write_results(path: str, results: dict) -> None:
    partial = f"{path}.partial"
    Path(partial).write_text(json.dumps(results))
    os.replace(partial, path)                 # the reader never sees half a file


def main(argv: list[str]) -> int:
    job_path, results_path = argv
    job = json.loads(Path(job_path).read_text())
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        print(f"vLLM is not importable: {e}", file=sys.stderr)
        return MISSING_VLLM
    versions = {"vllm": getattr(vllm, "__version__", None)}
    if "torch" in sys.modules:
        versions["torch"] = sys.modules["torch"].__version__
    results = {"versions": versions, "engine_start_s": None, "workloads": {}}
    start = time.perf_counter()
    llm = LLM(model=job["model"], **job["llm_options"])
    results["engine_start_s"] = time.perf_counter() - start
    write_results(results_path, results)
    for requests in job["warmup"]:            # first calls at these shapes, before any timing
        timed_generate(llm, SamplingParams, requests)
    for workload in job["workloads"]:
        print(f"vLLM: {workload['name']} ...", file=sys.stderr, flush=True)
        results["workloads"][workload["name"]] = run_workload(llm, SamplingParams, workload)
        write_results(results_path, results)
    del llm
    gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
