"""benchmarks/server_overhead.py's SimulatedGpuRunner behaves like a CUDA stream: steps run one
after another on the device in launch order, each starting when both its launch and the step
before it allow; wait() blocks until the step's device end; a step's fed rows read the ids of the
step launched before it; the enqueue is host CPU time. And its device-time model reproduces the
H100 figures it was fitted to, and the real engine runs to the same tokens on it as on the
instant runner."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import numpy as np
import pytest

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("server_overhead", ROOT / "benchmarks" / "server_overhead.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["server_overhead"] = bench            # its dataclasses look their module up there
_spec.loader.exec_module(bench)

BLOCK = 16
PLAIN = SamplingBatch.build([0.0], [0], [1.0], [0], [0])    # greedy; the runners only read its mask


def decode_batch(context_lens, token_ids=None) -> ForwardBatch:
    """A decode batch over private blocks (row i's blocks start at i * 1,000)."""
    width = -(-max(context_lens) // BLOCK)
    tables = np.asarray([[1000 * i + j for j in range(width)] for i in range(len(context_lens))], np.int32)
    ids = token_ids if token_ids is not None else [0] * len(context_lens)
    return ForwardBatch.build_decode(ids, context_lens, tables, BLOCK)


def prefill_batch(prompts: list[list[int]], cached: list[int] | None = None,
                  decode_rows: list[int] = ()) -> ForwardBatch:
    """A prefill-kind batch: one-token decode rows at the given contexts first, then each
    prompt's new tokens after its cached ones."""
    cached = cached or [0] * len(prompts)
    new = [[7] for _ in decode_rows] + prompts
    contexts = list(decode_rows) + [c + len(p) for c, p in zip(cached, prompts)]
    tables = [list(range(1000 * i, 1000 * i + -(-c // BLOCK))) for i, c in enumerate(contexts)]
    return ForwardBatch.build(new, contexts, tables, BLOCK, is_prefill=True)


def fixed_model(step_ms: float, enqueue_ms: float = 0.0):
    """Every decode step takes step_ms on the device and enqueue_ms on the host."""
    return bench.DeviceModel(decode_fixed_ms=step_ms, decode_seq_us=0, context_token_ns=0,
                             graph_enqueue_ms=enqueue_ms)


def test_steps_queue_on_the_stream_and_wait_blocks_until_the_device_end():
    runner = bench.SimulatedGpuRunner(fixed_model(40.0), num_kv_blocks=100)
    start = time.perf_counter()
    steps = [runner.launch(decode_batch([5, 9]), PLAIN) for _ in range(3)]
    launched = time.perf_counter()
    # launch() returns at once (no enqueue cost here): well before the first step's 40 ms device end
    assert launched - start < 0.04, "launch() returns at once (no enqueue cost here)"
    r = runner.records
    assert r[0].device_start == pytest.approx(r[0].enqueue_start)     # idle stream: starts at once
    for a, b in zip(r, r[1:]):
        assert b.device_start == a.device_end                        # in order, back to back
    assert r[-1].device_end == pytest.approx(r[0].device_start + 0.120)
    assert runner.stream_end == r[-1].device_end
    assert sum(x.device_s for x in r) == pytest.approx(0.120)
    steps[2].wait()                                                  # the last one first
    assert time.perf_counter() >= r[2].device_end
    assert time.perf_counter() - start >= 0.120
    assert r[2].wait_called < r[2].device_end <= r[2].woke
    t = time.perf_counter()
    first = steps[0].wait()                                          # long done: no wait
    assert time.perf_counter() - t < 0.02 and r[0].woke >= r[0].device_end   # no 40 ms sleep
    assert steps[0].wait() is first                                  # the same ids every call

    time.sleep(0.03)                          # the stream runs dry; the next step starts at its launch
    runner.launch(decode_batch([5]), PLAIN)
    assert r[3].device_start == r[3].enqueue_start > r[2].device_end


def test_fed_rows_read_the_previous_steps_ids_as_the_default_launch_does():
    """The same steps through SimulatedGpuRunner and the instant runner (ModelRunner's default
    launch, which resolves fed ids on the host): the same ids every step."""
    sim = bench.SimulatedGpuRunner(fixed_model(0.5), num_kv_blocks=100)
    ref = bench.InstantRunner()
    first = prefill_batch([[11, 12, 13], [21, 22]])
    fed = decode_batch([4, 3], token_ids=[0, 0])
    fed.fed_rows = np.asarray([1, 0], np.int32)          # row 0 gets the previous step's row 1
    again = decode_batch([5, 4], token_ids=[0, 0])
    again.fed_rows = np.asarray([0, 1], np.int32)
    sim_steps = [sim.launch(b, PLAIN) for b in (first, fed, again)]   # all before any wait
    ref_ids = [ref.launch(b, PLAIN).wait() for b in (first, fed, again)]
    sim_ids = [s.wait() for s in sim_steps]
    for a, b in zip(sim_ids, ref_ids):
        assert a.dtype == np.int32 and np.array_equal(a, b)
    expected = bench.next_tokens(decode_batch([4, 3], token_ids=[int(ref_ids[0][1]), int(ref_ids[0][0])]))
    assert np.array_equal(sim_ids[1], expected)
    lone = bench.SimulatedGpuRunner(fixed_model(0.5), num_kv_blocks=100)
    with pytest.raises(ValueError, match="launched before"):
        lone.launch(fed, PLAIN)


def test_a_pending_mask_is_resolved_by_the_wait_or_the_next_launch():
    import dataclasses

    from tinyvllm.structured.mask import PendingTokenMask
    runner = bench.SimulatedGpuRunner(fixed_model(0.5), num_kv_blocks=100)
    first, second = PendingTokenMask([]), PendingTokenMask([])
    runner.launch(decode_batch([5]), dataclasses.replace(PLAIN, token_mask=first))
    assert not first.resolved
    step = runner.launch(decode_batch([6]), dataclasses.replace(PLAIN, token_mask=second))
    assert first.resolved and not second.resolved          # the next launch samples the step before
    step.wait()
    assert second.resolved


def test_enqueue_is_host_cpu_time_and_the_device_waits_for_the_last_launch():
    model = bench.DeviceModel(launch_us=500.0, launches=20, prefill_fixed_ms=0.0, prefill_token_us=0.0,
                              attention_pair_ns=0.0)                # 10 ms of launches, no device work
    runner = bench.SimulatedGpuRunner(model, num_kv_blocks=100)
    cpu = time.thread_time()
    runner.launch(prefill_batch([[1, 2, 3]]), PLAIN)
    assert time.thread_time() - cpu >= 0.010
    r = runner.records[0]
    assert r.enqueue_end - r.enqueue_start >= 0.010
    assert r.device_end == r.enqueue_end and r.device_s == 0.0


def test_the_device_model_reproduces_its_fit():
    m = bench.DeviceModel()
    ms = lambda b: 1e3 * m.device_s(b)                   # noqa: E731
    assert ms(prefill_batch([[1] * 1984])) == pytest.approx(8.1, rel=0.02)
    assert ms(prefill_batch([[1] * 4096, [1] * 4096])) == pytest.approx(36.8, rel=0.03)
    mixed = prefill_batch([[1] * 1984], cached=[4096 - 1984], decode_rows=[3000] * 64)
    assert mixed.leading_decode_rows == 64
    assert ms(mixed) == pytest.approx(12.3, rel=0.04)
    assert ms(decode_batch([3000] * 64)) == pytest.approx(3.4, rel=0.02)
    assert 1e3 * m.enqueue_s(mixed) == pytest.approx(3.42)
    assert 1e3 * m.enqueue_s(decode_batch([3000] * 64)) == pytest.approx(0.1)
    assert ms(decode_batch([10] * 8)) * 2 == pytest.approx(1e3 * bench.DeviceModel(device_scale=2).device_s(
        decode_batch([10] * 8)))


def test_timeline_stats():
    R = bench.StepRecord
    records = [R(True, 2, 100, 0.000, 0.001, 0.000, 0.010, 0.010, 0.0, 0.0095, 0.011, 0.0005),
               R(False, 2, 2, 0.013, 0.0131, 0.013, 0.016, 0.003, 0.0025, 0.014, 0.017, 0.0040)]
    t = bench.timeline_stats(records)
    assert t["steps"] == 2 and t["wall_s"] == pytest.approx(0.016)
    assert t["gpu_busy"] == pytest.approx(0.013 / 0.016)
    assert t["host_gap_ms"] == pytest.approx(1.5)                     # (16 - 13) ms over 2 steps
    assert t["wake_ms"] == pytest.approx(1.0)                         # 11 - 10 and 17 - 16
    assert t["host_ms"] == pytest.approx(2.0) and t["host_cpu_ms"] == pytest.approx(2.0)
    assert t["prefill_steps"] == 1


def test_the_engine_runs_on_it_with_async_scheduling(tiny_model_dir):
    """The real engine, async scheduling on (the runner overlaps steps): the same tokens as on
    the instant runner, and decode steps launched ahead (fed rows) on the way."""
    def run(runner):
        engine = LLMEngine(tiny_model_dir, runner=runner, device="cpu", max_num_batched_tokens=64)
        for i, n in enumerate((40, 70, 10)):
            engine.add_request(str(i), list(range(100 + i, 100 + i + n)),
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        return engine, tokens
    sim_engine, sim_tokens = run(bench.SimulatedGpuRunner(fixed_model(0.2), num_kv_blocks=256))
    assert sim_engine.async_scheduling and sim_engine.step_ahead.num_launched > 0
    _, ref_tokens = run(bench.InstantRunner(num_kv_blocks=256))
    assert sim_tokens == ref_tokens and all(len(t) == 12 for t in sim_tokens.values())
    records = sim_engine.runner.records
    assert all(a.device_end <= b.device_start for a, b in zip(records, records[1:]))


def test_cuda_timeline_times_steps_by_their_events(monkeypatch):
    """--runner cuda's CudaTimeline, over a fake pycuda: each launch is bracketed by two events on
    the runner's stream, wait() by host clocks, and event times land on the host clock through
    the reference event (a step's device span is its events' span)."""
    import contextlib
    import types
    clock = {"t": 100.0}                       # the fake device's clock, ms

    class Event:
        def record(self, stream):
            self.at = clock["t"]
            clock["t"] += 2.5                  # each recorded point is 2.5 ms of device time later

        def time_till(self, other):
            return other.at - self.at

        def synchronize(self):
            pass
    fake = types.ModuleType("pycuda.driver")
    fake.Event = Event
    monkeypatch.setitem(sys.modules, "pycuda", types.ModuleType("pycuda"))
    monkeypatch.setitem(sys.modules, "pycuda.driver", fake)

    class Runner:
        stream = object()
        device = types.SimpleNamespace(active=contextlib.nullcontext)

        def launch(self, batch, sampling):
            return PendingStep(lambda: np.arange(batch.num_seqs, dtype=np.int32))
    from tinyvllm.engine.model_runner import PendingStep
    runner, marks = Runner(), []
    timeline = bench.CudaTimeline(runner, marks.append)
    steps = [runner.launch(decode_batch([40, 50]), PLAIN), runner.launch(prefill_batch([[1, 2, 3]]), PLAIN)]
    assert [s.wait().tolist() for s in steps] == [[0, 1], [0]]
    assert marks == ["launch", "enqueued", "launch", "enqueued", "wait", "woke", "wait", "woke"]
    records = timeline.records
    assert [(r.is_prefill, r.num_seqs, r.num_tokens) for r in records] == [(False, 2, 2), (True, 1, 3)]
    assert [round(r.device_s * 1e3, 6) for r in records] == [2.5, 2.5]          # start -> end events
    assert round((records[1].device_start - records[0].device_end) * 1e3, 6) == 2.5
    assert all(r.woke >= r.wait_called >= r.enqueue_end >= r.enqueue_start for r in records)


def test_profile_flag_names_its_threads_and_refuses_both_where_python_runs_one_profiler(monkeypatch, capsys):
    """--profile alone is both server threads; --profile engine / loop one of them. Python 3.12+
    runs one cProfile at a time in a process (a second enable() raises "Another profiling tool is
    already active"), so there --profile both is one clear usage error naming the choices."""
    parser = bench.build_parser()
    assert parser.parse_args(["--profile"]).profile == "both"
    assert parser.parse_args(["--profile", "engine"]).profile == "engine"
    assert parser.parse_args([]).profile is None
    monkeypatch.setattr(sys, "version_info", (3, 12, 0, "final", 0))
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--profile"])
    assert exit_.value.code == 2 and "--profile engine or --profile loop" in capsys.readouterr().err
