"""Engine statistics (engine/stats.py) on the numpy backend: the StepStats of a run add up to what
the requests did, preemptions and aborts are counted, nothing is collected unless asked for; the
stats log line; the metrics' histogram arithmetic (server/metrics.py)."""
from __future__ import annotations

import logging

import pytest

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.stats import StatsLogger, StepStats

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run(engine) -> list[StepStats]:
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step_stats)
    return steps


def test_step_stats_add_up_to_the_requests(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, device="cpu", max_model_len=128)
    engine.enable_stats()
    lengths = {"a": 5, "b": 9, "c": 1}
    for rid, n in lengths.items():
        engine.add_request(rid, f"Prompt {rid} says", SamplingParams(max_tokens=n, **GREEDY))
    prompt_lens = {rid: len(engine._requests[rid].prompt_token_ids) for rid in lengths}
    steps = run(engine)
    total = sum(lengths.values())
    assert sum(s.num_generation_tokens for s in steps) == total
    assert sum(s.num_prompt_tokens for s in steps) == sum(prompt_lens.values())
    assert sum(len(s.time_to_first_tokens) for s in steps) == len(lengths)
    assert sum(k for s in steps for _, k in s.inter_token_latencies) == total - len(lengths)
    assert all(gap > 0 for s in steps for gap, _ in s.inter_token_latencies)
    # tokens through the model: every prompt once, plus one per decode step and sequence
    assert sum(s.num_scheduled_tokens for s in steps) == sum(prompt_lens.values()) + total - len(lengths)
    finished = [f for s in steps for f in s.finished]
    assert sorted((f.num_generation_tokens, f.finish_reason) for f in finished) == \
        sorted((n, "length") for n in lengths.values())
    for f in finished:
        assert f.max_tokens == f.num_generation_tokens
        assert 0 <= f.queued_time <= f.e2e_latency and f.prefill_time > 0
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time)
        assert f.e2e_latency == pytest.approx(f.queued_time + f.inference_time)
    assert steps[-1].num_running == steps[-1].num_waiting == 0 and steps[-1].kv_cache_usage == 0
    # "c" (1 token) finishes in the prefill step; "a" and "b" decode together
    assert max(s.num_running for s in steps) == 2 and max(s.kv_cache_usage for s in steps) > 0
    assert engine.stats._preempted == {} and engine.stats._scheduled_at == {}   # nothing kept


def test_preemptions_aborts_and_waiting_are_counted(tiny_model_dir):
    # 4 blocks of 16 tokens for 3 running requests that each grow to 2 blocks: someone gets
    # preempted; a 4th request waits for a sequence slot until it is aborted
    engine = LLMEngine(tiny_model_dir, device="cpu", max_model_len=64, num_kv_blocks=4,
                       max_num_seqs=3)
    engine.enable_stats()
    for i in range(3):
        engine.add_request(str(i), [1] + [100 + i] * 12, SamplingParams(max_tokens=12, **GREEDY))
    engine.add_request("gone", "never runs", SamplingParams(max_tokens=4))
    engine.step()
    assert engine.last_step_stats.num_waiting >= 1
    engine.abort_request("gone")
    steps = [engine.last_step_stats] + run(engine)
    assert sum(s.num_preemptions for s in steps) == engine.num_preemptions >= 1
    finished = {f.finish_reason for s in steps for f in s.finished}
    assert finished == {"length", "abort"}
    abort = next(f for s in steps for f in s.finished if f.finish_reason == "abort")
    assert abort.num_generation_tokens == 0 and abort.prefill_time == 0 == abort.inference_time


def test_inter_token_gaps_match_a_per_token_oracle(tiny_model_dir):
    """Every generated token but a request's first has exactly one gap, measured from the step
    that produced the request's previous token, through preemptions (recomputed prompts),
    chunked prefill, aborts, one-token requests and requests arriving mid-run."""
    engine = LLMEngine(tiny_model_dir, device="cpu", max_model_len=96, num_kv_blocks=6,
                       max_num_seqs=4, max_num_batched_tokens=24)
    engine.enable_stats()
    previous_step, oracle, steps = {}, [], []       # request -> index of its last token's step

    def add(rid, prompt_len, max_tokens):
        engine.add_request(rid, [1] + [200 + len(rid)] * (prompt_len - 1),
                           SamplingParams(max_tokens=max_tokens, **GREEDY))

    for i in range(4):
        add(f"r{i}", 14, 20)
    add("long", 40, 6)                 # prefilled in two chunks
    add("one", 5, 1)
    while engine.has_unfinished_requests():
        index = len(steps)
        if index == 3:
            add("late", 10, 8)
        if index == 6:
            engine.abort_request("r1")
        before = {rid: len(r.seqs[0].token_ids) for rid, r in engine._requests.items()}
        for out in engine.step():
            new = out.outputs[0].num_generated_tokens - (before.get(out.request_id, 0) - out.num_prompt_tokens)
            if new > 0 and out.request_id in previous_step:
                oracle.append((previous_step[out.request_id], index))
            if new > 0:
                previous_step[out.request_id] = index
        steps.append(engine.last_step_stats)
    assert engine.num_preemptions >= 1
    times = {s.time: i for i, s in enumerate(steps)}
    measured = []
    for i, s in enumerate(steps):
        for gap, count in s.inter_token_latencies:
            previous = min(times, key=lambda t: abs(t - (s.time - gap)))   # float rounding
            assert abs(previous - (s.time - gap)) < 1e-6
            measured += [(times[previous], i)] * count
    assert sorted(measured) == sorted(oracle)
    assert sum(s.num_preemptions for s in steps) == engine.num_preemptions


def test_no_stats_unless_enabled(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, device="cpu", max_model_len=64)
    engine.add_request("x", "Hi", SamplingParams(max_tokens=2))
    run(engine)
    assert engine.stats is None and engine.last_step_stats is None


def test_stats_logger_line_and_idle_quiet():
    messages = []

    class Capture(logging.Handler):
        def emit(self, record):
            messages.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("test-stats-logger")
    logger.addHandler(Capture())
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    stats = StatsLogger(interval_s=5.0, logger=logger)
    stats._since = 100.0
    stats.record(StepStats(101.0, 3, 2, 0.25, 100, 40, 140, 0, 0, 0, (), (), ()))
    stats.record(StepStats(102.0, 3, 1, 0.5, 0, 60, 3, 0, 0, 0, (), (), ()))
    assert stats.maybe_log(now=104.0) is None                     # not 5 s yet
    line = stats.maybe_log(now=110.0)
    assert line == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 50.0%, "
                    "Prefix cache hit rate: 0.0%")
    stats.record(StepStats(111.0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, (), (), ()))
    stats.maybe_log(now=120.0)                                    # the interval after busy: INFO
    stats.maybe_log(now=130.0)                                    # idle: DEBUG
    assert [level for level, _ in messages] == [logging.INFO, logging.INFO, logging.DEBUG]


def test_engine_logs_its_size_at_start(tiny_model_dir):
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("tinyvllm.engine")
    handler, level = Capture(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        engine = LLMEngine(tiny_model_dir, device="cpu", max_model_len=128, num_kv_blocks=40)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = "\n".join(records)
    assert f"{engine.model_config.num_parameters:,} parameters" in text
    assert "40 blocks of 16 tokens = 640 tokens" in text
    assert "maximum concurrency for 128 tokens per request: 5.00x" in text


def test_histogram_buckets_and_weights():
    pytest.importorskip("prometheus_client")
    from tinyvllm.server.metrics import Histogram, buckets_1_2_5
    h = Histogram((0.1, 1.0))
    h.observe(0.1)                 # le is inclusive
    h.observe(0.5, count=3)
    h.observe(7.0)
    assert h.cumulative() == [("0.1", 1), ("1.0", 4), ("+Inf", 5)]
    assert h.count == 5 and h.sum == pytest.approx(0.1 + 1.5 + 7.0)
    assert buckets_1_2_5(256) == (1, 2, 5, 10, 20, 50, 100, 200)
