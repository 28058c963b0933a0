"""tensor_parallel_size=1 on one GPU (marker gpu): rank 0 in the engine process
(tinyvllm/parallel/workers.py; no rank process at all), the CUDA runner with a one-rank NCCL
communicator whose all-reduces its decode graphs capture, gives the default in-process path's
tokens — greedy, and sampled with logprobs."""
from __future__ import annotations

import pytest
from test_tensor_parallel_engine import run_outputs as run

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import GPUUnavailableError

OPTIONS = dict(kv_cache_gb=0.5, max_model_len=1024)
PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8", "Once upon a time, in a land far", "a"]


@pytest.mark.gpu
def test_one_rank_process_over_nccl_equals_the_default_path(tiny_model_dir):
    from tinyvllm.gpu.nccl import load_libnccl
    from tinyvllm.parallel.workers import RankProcesses
    try:
        load_libnccl()
    except GPUUnavailableError as e:
        pytest.skip(str(e))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, logprobs=2, ignore_eos=True)
    default = LLMEngine(tiny_model_dir, **OPTIONS)
    try:
        want = [run(default, PROMPTS, greedy), run(default, PROMPTS[:2], sampled)]
    finally:
        default.close()
    ranked = LLMEngine(tiny_model_dir, tensor_parallel_size=1, **OPTIONS)
    try:
        assert isinstance(ranked.runner, RankProcesses) and ranked.runner.overlaps_steps
        assert not ranked.runner.processes and ranked.runner.communicator.world_size == 1
        assert ranked.async_scheduling
        got = [run(ranked, PROMPTS, greedy), run(ranked, PROMPTS[:2], sampled)]
        report = ranked.runner.memory_report()
        assert report.startswith("rank 0:\n") and "decode graphs captured for batch sizes [" in report
    finally:
        ranked.close()
    for g, w in zip(got, want):
        assert [o.token_ids for o in g] == [o.token_ids for o in w]
    for g, w in zip(got[1], want[1]):
        assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]
