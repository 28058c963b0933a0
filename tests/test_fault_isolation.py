"""Fault isolation in LLMEngine.step() on the numpy backend, with faults injected: a request whose
batch row cannot be built, or whose logits are not finite, fails alone (finish_reason "error",
a clear RequestOutput.error) while the others finish exactly as they would have; a runner
failure no request can be blamed for kills the engine with EngineDeadError."""
from __future__ import annotations

import numpy as np
import pytest
from fake_runners import POISONED_SEED, DyingRunner, NaNRunner

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import EngineDeadError

OPTIONS = dict(device="cpu", block_size=4, num_kv_blocks=48, max_num_seqs=8, max_model_len=192)


@pytest.fixture(scope="module")
def numpy_runner(tiny_model_dir):
    return LLMEngine(tiny_model_dir, **OPTIONS).runner


def make_engine(tiny_model_dir, runner=None):
    return LLMEngine(tiny_model_dir, runner=runner, **OPTIONS)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1000, 100000, rng.integers(3, 30))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def run(engine, requests):
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return finals


@pytest.fixture(scope="module")
def expected(tiny_model_dir, numpy_runner):
    """Each prompt's greedy tokens with nothing going wrong."""
    return {str(i): numpy_runner.model.greedy_generate(p, GREEDY.max_tokens) for i, p in enumerate(prompts(6))}


def good_requests():
    return {str(i): (p, GREEDY) for i, p in enumerate(prompts(6))}


def assert_healthy(finals, expected):
    for request_id, tokens in expected.items():
        out = finals[request_id]
        assert out.finish_reason == "length" and out.error is None, request_id
        assert out.token_ids == tokens, request_id


def test_a_row_that_cannot_be_built_fails_only_its_request(tiny_model_dir, numpy_runner, expected):
    """The issue's case: top_k = 2**31 does not fit the int32 sampling array. Admission refuses
    it (see the admission tests); here it is forced past admission to test the step itself."""
    engine = make_engine(tiny_model_dir, numpy_runner)
    for request_id, (prompt, params) in good_requests().items():
        engine.add_request(request_id, prompt, params)
    engine.add_request("bad", "Hello there", SamplingParams(temperature=0.5, max_tokens=10))
    engine._requests["bad"].params.top_k = 2**31                 # slipped past admission
    finals = run(engine, {})
    bad = finals["bad"]
    assert bad.finish_reason == "error" and bad.finished and bad.token_ids == []
    assert "batch row" in bad.error and "OverflowError" in bad.error
    assert_healthy(finals, expected)
    assert engine.dead is None


def test_a_failure_mid_generation_fails_only_that_request(tiny_model_dir, numpy_runner, expected):
    engine = make_engine(tiny_model_dir, numpy_runner)
    for request_id, (prompt, params) in good_requests().items():
        engine.add_request(request_id, prompt, params)
    engine.add_request("bad", "Hello there", SamplingParams(temperature=0.5, max_tokens=10))
    finals = {}
    for _ in range(3):                                           # the prefill and two decodes
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    engine._requests["bad"].seed = 2**64                         # no longer fits uint64
    finals.update(run(engine, {}))
    assert finals["bad"].finish_reason == "error" and 0 < len(finals["bad"].token_ids) < 10
    assert "OverflowError" in finals["bad"].error
    assert_healthy(finals, expected)


@pytest.mark.parametrize("value, after", [(np.nan, 0), (np.inf, 4), (-np.inf, 2)])
def test_non_finite_logits_fail_only_that_request(tiny_model_dir, numpy_runner, expected, value, after):
    """-inf at one token is a legal logit (no mass): only NaN and +inf break a row."""
    engine = make_engine(tiny_model_dir, NaNRunner(numpy_runner, value, after))
    victim = SamplingParams(temperature=0.7, seed=POISONED_SEED, max_tokens=10, ignore_eos=True)
    finals = run(engine, {**good_requests(), "victim": ("Tell me a story", victim)})
    out = finals["victim"]
    if np.isneginf(value):
        assert out.finish_reason == "length" and len(out.token_ids) == 10
    else:
        assert out.finish_reason == "error" and len(out.token_ids) == after
        assert "non-finite logits" in out.error
    assert_healthy(finals, expected)


def test_a_runner_failure_kills_the_engine_cleanly(tiny_model_dir, numpy_runner):
    engine = make_engine(tiny_model_dir, DyingRunner(numpy_runner, good_steps=3))
    for request_id, (prompt, params) in good_requests().items():
        engine.add_request(request_id, prompt, params)
    for _ in range(3):
        engine.step()
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        engine.step()
    assert engine.dead and "RuntimeError" in engine.dead
    with pytest.raises(EngineDeadError, match="dead"):           # and stays dead: no half-working engine
        engine.step()
    with pytest.raises(EngineDeadError, match="dead"):
        engine.add_request("late", "Hello", GREEDY)


def test_a_build_failure_no_row_reproduces_alone_kills_the_engine(tiny_model_dir, numpy_runner, monkeypatch):
    from tinyvllm.engine import scheduler
    engine = make_engine(tiny_model_dir, numpy_runner)
    for request_id, (prompt, params) in good_requests().items():
        engine.add_request(request_id, prompt, params)
    real = scheduler.ScheduledBatch.sampling_batch

    def fails_when_batched(self):
        if len(self.seqs) > 1:
            raise MemoryError("host out of memory")
        return real(self)
    monkeypatch.setattr(scheduler.ScheduledBatch, "sampling_batch", fails_when_batched)
    with pytest.raises(EngineDeadError, match="MemoryError"):
        engine.step()


def test_a_dead_engine_fails_everyone_and_stops_the_server_loop(tiny_model_dir, numpy_runner):
    """server/engine_loop.py: EngineDeadError fails every request in flight with the reason,
    turns /health red (healthy False), refuses new requests and calls the server's exit hook."""
    import asyncio

    from tinyvllm.server.engine_loop import EngineLoop
    from tinyvllm.server.request_stream import EngineFailure

    loop = EngineLoop(make_engine(tiny_model_dir, DyingRunner(numpy_runner, good_steps=2)))
    reasons = []
    loop.on_dead = reasons.append
    loop.start()

    async def scenario():
        streams = [await loop.submit(f"r{i}", "Hello there", GREEDY) for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineFailure, match="illegal memory access"):
                while not (await stream.next_event()).finished:
                    pass
        with pytest.raises(EngineFailure):
            await loop.submit("late", "Hello", GREEDY)
    try:
        asyncio.run(scenario())
        assert loop.dead and "illegal memory access" in loop.dead and reasons == [loop.dead]
        assert not loop.healthy
    finally:
        loop.stop()
