"""Async scheduling (engine/step_ahead.py's docstring) on the numpy backend: the engine launches
decode step N+1 before it reads step N back, through ModelRunner.launch's default (the step
runs when waited for, its fed token ids resolved from the step before). Whatever goes ahead,
the outputs must be those of the same engine without it: the same RequestOutputs from the same
step() calls where no request arrives mid-way, and the same final outputs always — stops by
token id and by string landing on rows already launched ahead (their tokens thrown away),
aborts, samples of n > 1, late arrivals, preemption, and rows that cannot go ahead
(penalties, logprobs)."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.step_ahead import StepAhead

OPTIONS = dict(device="cpu", block_size=4, max_num_seqs=8, max_model_len=48)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1000, 100000, rng.integers(2, 20))] for _ in range(n)]


def snapshot(out):
    """Everything a caller sees in one RequestOutput, read at once (the fields are views):
    (request id, finished, per sample (index, token ids, text, delta, finish and stop reason,
    logprob entries' (token, rank)), the logprob values)."""
    samples = tuple((o.index, tuple(o.token_ids), o.text, o.delta_text, o.finish_reason, o.stop_reason,
                     None if o.logprobs is None else tuple(tuple(sorted((t, lp.rank) for t, lp in e.items()))
                                                           for e in o.logprobs))
                    for o in out.outputs)
    values = [v for o in out.outputs if o.logprobs is not None
              for v in [o.cumulative_logprob] + [lp.logprob for e in o.logprobs for _, lp in sorted(e.items())]]
    return out.request_id, out.finished, samples, tuple(values)


def assert_same_outputs(got: dict, expected: dict) -> None:
    """Equal, but for logprob values: a request that arrives mid-way joins batches made up
    differently with and without async scheduling, and the fp32 logits of one row computed in
    batches of different sizes differ in summation order (numpy's BLAS blocks by the batch)
    — a few ulps of the logits (3e-7 relative seen), which rtol 1e-5 covers with room."""
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key][:3] == expected[key][:3], key
        np.testing.assert_allclose(got[key][3], expected[key][3], rtol=1e-5, err_msg=key)


def run(model_dir, script, **options):
    """script: {step() call number: [("add", id, prompt, params) | ("abort", id)]}, applied before
    that call. -> (the snapshots of each call's outputs, the final snapshot of each request,
    the engine)."""
    engine = LLMEngine(model_dir, **{**OPTIONS, **options})
    calls, finals, call = [], {}, 0
    while call <= max(script) or engine.has_unfinished_requests():
        for action in script.get(call, []):
            if action[0] == "add":
                engine.add_request(*action[1:])
            else:
                engine.abort_request(action[1])
        outs = [snapshot(o) for o in engine.step()]
        calls.append(outs)
        finals.update((o[0], o) for o in outs if o[1])
        call += 1
        assert call < 500
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    return calls, finals, engine


def greedy_tokens(model_dir, prompt, n):
    engine = LLMEngine(model_dir, **OPTIONS, async_scheduling=False)
    engine.add_request("x", prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))
    while engine.has_unfinished_requests():
        outs = engine.step()
    return list(outs[0].outputs[0].token_ids), outs[0].outputs[0].text


def test_async_steps_are_the_sync_steps(tiny_model_dir):
    """One batch from the start: every step() call reports exactly what it reports without
    async scheduling, while most decode steps went ahead and stopped rows were thrown away."""
    p = prompts(7)
    tokens, text = greedy_tokens(tiny_model_dir, p[1], 12)
    greedy = dict(temperature=0.0, ignore_eos=True)
    requests = [
        ("long", p[0], SamplingParams(max_tokens=14, **greedy)),
        ("stop-id", p[1], SamplingParams(max_tokens=12, stop_token_ids=[tokens[4]], **greedy)),
        ("stop-str", p[1], SamplingParams(max_tokens=12, stop=[text[len(text) // 2:][:3]], **greedy)),
        ("sampled", p[2], SamplingParams(max_tokens=11, temperature=0.9, top_p=0.95, top_k=50, seed=7)),
        ("one", p[3], SamplingParams(max_tokens=1, **greedy)),
        ("aborted", p[4], SamplingParams(max_tokens=20, temperature=0.7, seed=3)),
        ("context", p[5] + p[6] + p[5], SamplingParams(max_tokens=40, **greedy)),   # ends at the limit
    ]
    script = {0: [("add", *r) for r in requests], 5: [("abort", "aborted")]}
    sync_calls, sync_finals, _ = run(tiny_model_dir, script, async_scheduling=False)
    async_calls, async_finals, engine = run(tiny_model_dir, script, async_scheduling=True)
    assert async_calls == sync_calls
    assert {k: v[2][0][4] for k, v in sync_finals.items()} == {
        "long": "length", "stop-id": "stop", "stop-str": "stop", "sampled": "length", "one": "length",
        "aborted": "abort", "context": "length"}
    print(f"{engine.step_ahead.num_launched} steps ahead, {engine.step_ahead.num_rows_thrown_away} rows thrown away, "
          f"{len(sync_calls)} calls")
    assert engine.step_ahead.num_launched >= len(sync_calls) - 4     # all but the prefill and the tail
    assert engine.step_ahead.num_rows_thrown_away >= 3                  # two stops and the abort


def test_the_first_decode_step_goes_ahead_of_the_prefill(tiny_model_dir):
    """A prefill of every running sequence that ends their prompts is followed by a decode step
    launched before its first tokens come back (fed from its sampled ids): every decode step of
    a lone request goes ahead, and each step() call reports what it does without it. Not so
    where another request waits, or where the prefill's first sample releases its n > 1 others:
    their prefill comes first, as without async scheduling."""
    p = prompts(3, seed=3)
    lone = {0: [("add", "x", p[0], SamplingParams(temperature=0, ignore_eos=True, max_tokens=7))]}
    sync_calls, _, _ = run(tiny_model_dir, lone, async_scheduling=False)
    async_calls, _, engine = run(tiny_model_dir, lone, async_scheduling=True)
    assert async_calls == sync_calls
    assert engine.step_ahead.num_launched == 6, "the 6 decode steps after the prefill all went ahead"
    samples = {0: [("add", "n", p[1], SamplingParams(temperature=0.8, seed=4, ignore_eos=True, max_tokens=5, n=2))]}
    sync_calls, _, _ = run(tiny_model_dir, samples, async_scheduling=False)
    async_calls, _, engine = run(tiny_model_dir, samples, async_scheduling=True)
    assert async_calls == sync_calls
    assert engine.step_ahead.num_launched < len(sync_calls) - 1, "the held sample's prefill came before a decode step"


def test_async_outputs_are_the_sync_outputs_with_arrivals_samples_and_preemption(tiny_model_dir):
    """Requests arriving mid-way, n = 3 samples, penalties and logprobs (rows that hold the
    batch back), an abort, and a KV cache small enough to preempt: the same final outputs."""
    p = prompts(8, seed=1)
    greedy = dict(temperature=0.0, ignore_eos=True)
    script = {
        0: [("add", "a", p[0], SamplingParams(max_tokens=9, **greedy)),
            ("add", "b", p[1], SamplingParams(max_tokens=16, temperature=0.8, seed=11, n=3))],
        3: [("add", "c", p[2], SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=5))],
        6: [("add", "pen", p[3], SamplingParams(max_tokens=8, repetition_penalty=1.3, temperature=0))],
        8: [("abort", "c")],
        9: [("add", "lp", p[4], SamplingParams(max_tokens=6, logprobs=2, temperature=0))],
        13: [("add", "min", p[5], SamplingParams(max_tokens=10, min_tokens=4, temperature=0.5, seed=2))],
        15: [("add", "d", p[6], SamplingParams(max_tokens=14, **greedy)),
             ("add", "e", p[7], SamplingParams(max_tokens=14, temperature=0.6, seed=9))],
    }
    small = dict(num_kv_blocks=18)
    _, sync_finals, sync_engine = run(tiny_model_dir, script, async_scheduling=False, **small)
    _, async_finals, engine = run(tiny_model_dir, script, async_scheduling=True, **small)
    assert sync_engine.num_preemptions > 0 and engine.num_preemptions > 0, "the cache was meant to preempt"
    # c is aborted by step() call number, not by its token count: a request that arrives while a
    # step is launched ahead is admitted one step later (that step is on its way), and the rows
    # already running decode in both. So c's tokens at the abort are one stream cut one token
    # apart at most; everything else is equal.
    (sync_c, async_c) = (finals.pop("c")[2][0] for finals in (sync_finals, async_finals))
    shorter = min(len(sync_c[1]), len(async_c[1]))
    assert sync_c[1][:shorter] == async_c[1][:shorter] and abs(len(sync_c[1]) - len(async_c[1])) <= 1
    assert sync_c[4] == async_c[4] == "abort"
    assert_same_outputs(async_finals, sync_finals)
    assert async_finals["lp"][3]
    assert engine.step_ahead.num_launched > 0


def test_async_is_the_default_only_where_the_runner_overlaps(tiny_model_dir):
    assert LLMEngine(tiny_model_dir, **OPTIONS).async_scheduling is False      # numpy: no overlap
    assert LLMEngine(tiny_model_dir, **OPTIONS, async_scheduling=True).async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


class EchoRunner(ModelRunner):
    """Returns each sequence's last new token id + 1: what the step was fed, visibly."""
    num_kv_blocks = 8

    def execute(self, batch, sampling):
        return batch.token_ids[batch.last_token_indices] + 1


def test_fed_tokens_are_the_previous_steps_sampled_ids():
    runner = EchoRunner()
    tables = np.zeros((3, 1), np.int32)
    first = runner.launch(ForwardBatch.build_decode([10, 20, 30], [1, 1, 1], tables, 4), SamplingBatch.greedy(3))
    fed = ForwardBatch.build_decode([0, 0, 7], [2, 2, 2], tables, 4)
    fed.fed_rows = np.asarray([2, 0, -1], np.int32)        # rows 2 and 0 of `first`; a known id
    second = runner.launch(fed, SamplingBatch.greedy(3))
    assert second.wait().tolist() == [32, 12, 8]
    assert first.wait().tolist() == [11, 21, 31]
    with pytest.raises(ValueError, match="step launched before"):
        EchoRunner().launch(fed, SamplingBatch.greedy(3))


def test_prompt_chunks_go_ahead_beside_decode_rows(tiny_model_dir):
    """A prompt longer than the token budget, arriving while another request decodes, is chunked
    over several steps; under async scheduling those mixed steps are launched ahead too (each
    chunk after the one still in flight, the decoding row's id fed from it) and every request
    gets sync scheduling's outputs (its steps are sync's, a call later: the requests arrived
    while a step was on its way)."""
    rng = np.random.default_rng(7)
    long_prompt = [int(t) for t in rng.integers(1000, 100000, 30)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    script = {0: [("add", "decoding", prompts(1, seed=8)[0], SamplingParams(max_tokens=14, **greedy))],
              2: [("add", "long", long_prompt, SamplingParams(max_tokens=5, **greedy)),
                  ("add", "sampled", prompts(2, seed=9)[1],
                   SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=3))]}
    small_budget = dict(max_num_batched_tokens=8)
    _, sync_finals, _ = run(tiny_model_dir, script, async_scheduling=False, **small_budget)
    chunks_ahead = []
    launch = StepAhead._launch

    def logged(self, batch, rows):
        launched = launch(self, batch, rows)
        if launched is not None:
            chunks_ahead.extend((s.request_id, n) for s, n in zip(launched[0].seqs, launched[2]) if n > 1)
        return launched
    StepAhead._launch = logged
    try:
        _, async_finals, _ = run(tiny_model_dir, script, async_scheduling=True, **small_budget)
    finally:
        StepAhead._launch = launch
    assert_same_outputs(async_finals, sync_finals)
    long_chunks = [n for rid, n in chunks_ahead if rid == "long"]
    assert len(long_chunks) >= 3 and sum(long_chunks) == len(long_prompt), long_chunks   # each chunk went ahead
