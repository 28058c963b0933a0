"""The bench's workloads and results: what the tinyvllm runs (bench/run.py), the HF runs
(bench/hf.py), the vLLM runs (bench/vllm.py) and the report (bench/report.py) share — the bottom
of the bench package, so the others import it and never each other in a cycle."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tinyvllm.errors import TinyVLLMError

PROMPT_TOKEN_ID_LIMIT = 10_000        # ids drawn from [0, 10000), as nano-vllm's benchmark does


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_requests: int
    prompt_len: tuple[int, int]       # inclusive range; equal ends = a fixed length
    output_len: tuple[int, int]
    repeats: int = 1                  # runs; the median is reported (the latency run is short)
    shared_prefix: int = 0            # tokens of one system prompt before every prompt_len ones

    @property
    def max_context(self) -> int:
        return self.shared_prefix + self.prompt_len[1] + self.output_len[1]

    def requests(self, seed: int) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        prompt_lens = rng.integers(self.prompt_len[0], self.prompt_len[1] + 1, self.num_requests)
        output_lens = rng.integers(self.output_len[0], self.output_len[1] + 1, self.num_requests)
        system = rng.integers(0, PROMPT_TOKEN_ID_LIMIT, self.shared_prefix).tolist()
        return [BenchRequest(system + rng.integers(0, PROMPT_TOKEN_ID_LIMIT, int(p)).tolist(), int(o))
                for p, o in zip(prompt_lens, output_lens)]


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


WORKLOADS = {
    "latency": WorkloadSpec("latency", 1, (128, 128), (256, 256), repeats=3),
    "batch64": WorkloadSpec("batch64", 64, (128, 128), (128, 128)),
    "throughput": WorkloadSpec("throughput", 256, (100, 1024), (100, 1024)),
    # chat-like traffic: one 1,024-token system prompt, then 64-256 tokens of each request's own;
    # run with the prefix cache on and off (bench/run.py)
    "prefix": WorkloadSpec("prefix", 256, (64, 256), (128, 128), shared_prefix=1024),
}   # in run order: HF's estimate of the throughput run needs its batch64 timing
# Prefill at batch 1 and a small decode batch, so that compiling, first calls and graph capture
# are paid before anything is timed.
WARMUP = [WorkloadSpec("warmup", 1, (128, 128), (16, 16)),
          WorkloadSpec("warmup", 8, (32, 32), (8, 8))]


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
    shared = min(spec.shared_prefix, max_len) if max_len else spec.shared_prefix
    return dataclasses.replace(spec, num_requests=count, prompt_len=lengths(*spec.prompt_len),
                               output_len=lengths(*spec.output_len), shared_prefix=shared)


@dataclass
class WorkloadResult:
    backend: str                       # "tinyvllm", "hf" or "vllm"
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
    # the prefix workload: ttft_ms is the median, and the same run with the cache off is nested
    ttft_p99_ms: float | None = None
    prefix_cache_hit_rate: float | None = None    # hit tokens / queried tokens
    cache_off: WorkloadResult | None = None
    outputs_identical: bool | None = None         # greedy outputs equal with the cache on and off

    def finish(self, wall_s: float) -> WorkloadResult:
        self.wall_s = wall_s
        self.output_tok_s = self.output_tokens / wall_s
        self.total_tok_s = (self.prompt_tokens + self.output_tokens) / wall_s
        if self.decode_tok_s:
            self.ms_per_token = 1000.0 / self.decode_tok_s
        return self
