"""Rank 0 in the engine process, the other ranks in spawned processes (parallel/workers.py), on
the numpy backend: two ranks give the threaded twin's tokens, logprobs and prompt logits bit for
bit (parallel/numpy_ranks.py: the same sums in the same order) and one rank's tokens; a rank
that fails at start-up or in a step, or dies, is one error in the engine, never a hang; close()
stops every rank process."""
from __future__ import annotations

import numpy as np
import pytest
from test_tensor_parallel_engine import run_outputs as run

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import EngineDeadError, ModelLoadError
from tinyvllm.parallel import workers

CPU = dict(device="cpu", num_kv_blocks=64, max_model_len=256, block_size=4)
PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8", "Once upon a time, in a land far", "a"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=6, logprobs=3, ignore_eos=True)


def rank_processes(model_dir, size: int, **options) -> workers.RankProcesses:
    config = ModelConfig.from_pretrained(model_dir)
    return workers.RankProcesses(config, EngineConfig(tensor_parallel_size=size, **dict(CPU, **options)),
                                 model_dir, None)


def logprobs_of(outputs) -> list:
    return [[{t: (v.logprob, v.rank) for t, v in step.items()} for step in o.logprobs] for o in outputs]


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_two_ranks_in_processes_equal_the_threaded_twin_and_one_rank(tiny_model_dir, options):
    one = LLMEngine(tiny_model_dir, **dict(CPU, **options))
    threaded = LLMEngine(tiny_model_dir, tensor_parallel_size=2, **dict(CPU, **options))
    processes = LLMEngine(tiny_model_dir, runner=rank_processes(tiny_model_dir, 2, **options), **dict(CPU, **options))
    try:
        ranks = processes.runner
        assert len(ranks.processes) == 1 and ranks.processes[0].is_alive() and ranks.num_kv_blocks == 64
        want = [o.token_ids for o in run(one, PROMPTS, GREEDY)]
        assert [o.token_ids for o in run(threaded, PROMPTS, GREEDY)] == want
        assert [o.token_ids for o in run(processes, PROMPTS, GREEDY)] == want
        assert len({tuple(t) for t in want}) > 1
        sampled = [run(e, PROMPTS[:2], SAMPLED) for e in (one, threaded, processes)]
        assert [o.token_ids for o in sampled[2]] == [o.token_ids for o in sampled[0]]
        assert logprobs_of(sampled[2]) == logprobs_of(sampled[1])          # the same bits
        for got, want_lp in zip(logprobs_of(sampled[2]), logprobs_of(sampled[0])):
            for g, w in zip(got, want_lp):
                assert g.keys() == w.keys()
                np.testing.assert_allclose([lp for lp, _ in g.values()], [lp for lp, _ in w.values()], atol=1e-4)
        tokens = [1, 5, 9, 2, 7]
        np.testing.assert_array_equal(ranks.prompt_logits(tokens), threaded.runner.prompt_logits(tokens))
        report = ranks.memory_report()
        assert "rank 0:\nnumpy rank 0 of 2:" in report and "rank 1:\nnumpy rank 1 of 2:" in report
    finally:
        for engine in (one, threaded, processes):
            engine.close()


def test_close_stops_every_rank_process(tiny_model_dir):
    runner = rank_processes(tiny_model_dir, 4)
    started = list(runner.processes)
    assert len(started) == 3 and all(p.is_alive() for p in started)
    runner.close()
    assert all(p.exitcode == 0 for p in started) and not runner.processes and runner.local is None


# ranks 1..N-1 run these in their processes (spawn imports this module there)
def rank_main_that_cannot_load(*args):
    def fail(*_):
        raise ModelLoadError("rank 1 cannot read its shards")
    workers.build_rank = fail
    workers.rank_main(*args)


def rank_main_that_dies_loading(*args):
    raise SystemExit(3)


def rank_main_that_breaks_in_step_3(*args):
    from tinyvllm.parallel.numpy_rank import NumpyRank
    execute, steps = NumpyRank.execute, []

    def breaks(self, batch, sampling):
        steps.append(batch)
        if len(steps) == 3:
            raise ValueError("rank 1 broke in step 3")
        return execute(self, batch, sampling)
    NumpyRank.execute = breaks
    workers.rank_main(*args)


@pytest.mark.parametrize("main,error,says", [
    (rank_main_that_cannot_load, ModelLoadError, "^rank 1 cannot read its shards$"),
    (rank_main_that_dies_loading, RuntimeError, "^rank 1's process died \\(exit code 3\\)$")])
def test_a_rank_that_fails_at_start_up_is_its_error_here(tiny_model_dir, monkeypatch, main, error, says):
    monkeypatch.setattr(workers, "rank_main", main)
    with pytest.raises(error, match=says):
        rank_processes(tiny_model_dir, 2)


def test_a_rank_that_fails_in_a_step_kills_the_engine_with_its_error(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(workers, "rank_main", rank_main_that_breaks_in_step_3)
    engine = LLMEngine(tiny_model_dir, runner=rank_processes(tiny_model_dir, 2), **CPU)
    started = list(engine.runner.processes)
    with pytest.raises(EngineDeadError, match="rank 1: ValueError: rank 1 broke in step 3"):
        run(engine, PROMPTS, GREEDY)
    engine.close()
    assert all(p.exitcode is not None for p in started)


def test_a_rank_that_dies_mid_run_kills_the_engine(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, runner=rank_processes(tiny_model_dir, 2), **CPU)
    engine.add_request("0", PROMPTS[0], GREEDY)
    engine.step()
    engine.runner.processes[0].kill()
    engine.runner.processes[0].join(10)
    with pytest.raises(EngineDeadError, match="rank 1's process (died|stopped) \\(exit code -9\\)"):
        while engine.has_unfinished_requests():
            engine.step()
    engine.close()


class FakeCudaRank:
    """A rank's runner where no GPU is: the start-up's order is what is tested."""
    num_kv_blocks, overlaps_steps, supports_logprobs, supports_prompt_logprobs = 7, True, True, False
    closed = False

    def close(self):
        self.closed = True


def rank_main_that_fails_joining_nccl(*args):
    from tinyvllm.parallel import cuda_rank

    def fail(*_):
        raise RuntimeError("ncclCommInitRank(rank 1 of 2) failed: unhandled system error")
    workers.build_rank = lambda *_: FakeCudaRank()
    cuda_rank.connect = fail
    workers.rank_main(*args)


def test_a_rank_that_fails_while_nccl_starts_is_its_error_not_a_wait(tiny_model_dir, monkeypatch):
    """cuda's start-up over two ranks, the GPU work faked: rank 0 waits in NCCL's start (as
    ncclCommInitRank waits for every rank) on its thread, rank 1 fails in its own; the engine
    raises rank 1's error instead of waiting, and gives rank 0's runner back."""
    import threading

    from tinyvllm.gpu import nccl
    from tinyvllm.parallel import cuda_rank
    here, released = FakeCudaRank(), threading.Event()
    monkeypatch.setattr(nccl, "new_unique_id", lambda: bytes(nccl.UNIQUE_ID_BYTES))
    monkeypatch.setattr(workers, "build_rank", lambda *_: here)
    monkeypatch.setattr(cuda_rank, "connect", lambda *_: released.wait(60))
    monkeypatch.setattr(workers, "rank_main", rank_main_that_fails_joining_nccl)
    config = ModelConfig.from_pretrained(tiny_model_dir)
    try:
        with pytest.raises(RuntimeError, match="^rank 1: RuntimeError: ncclCommInitRank\\(rank 1 of 2\\) failed"):
            workers.RankProcesses(config, EngineConfig(device="cuda", tensor_parallel_size=2), tiny_model_dir, None)
        assert here.closed
    finally:
        released.set()
