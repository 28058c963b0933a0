"""Scheduler + BlockManager driven by a fake runner whose "model" reads its context back through
the paged cache: the next token is a hash of every token in the context, so any paging,
preemption or recompute mistake changes the output."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence, SequenceStatus

EOS = 0


class NullDetokenizer:
    def add(self, token_id):
        return ""

    def flush(self):
        return ""


def next_token(context) -> int:
    return int(sum((i + 1) * t for i, t in enumerate(context)) % 997) + 1     # never EOS


class FakeRunner:
    """Stores token ids as its 'K/V' and checks that every context position was written."""

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.slots = np.full(num_blocks * block_size, -1, np.int64)
        self.batches = []

    def execute(self, batch, sampling):
        self.batches.append((batch.is_prefill, batch.num_seqs, batch.num_tokens))
        self.slots[batch.slot_mapping] = batch.token_ids
        out = []
        for i in range(batch.num_seqs):
            n = int(batch.context_lens[i])
            pos = np.arange(n)
            ctx = self.slots[batch.block_tables[i][pos // self.block_size] * self.block_size
                             + pos % self.block_size]
            assert (ctx >= 0).all(), "read a slot that was never written"
            out.append(next_token(ctx))
        return np.array(out, np.int32)


def alone(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def setup(num_blocks=64, block_size=4, context_limit=1000, **cfg):
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, device="cpu", **cfg)
    bm = BlockManager(num_blocks, block_size)
    return (Scheduler(config, bm, OutputProcessor(None, (EOS,), context_limit)), bm,
            FakeRunner(num_blocks, block_size))


def add(sched, request_id, prompt, max_tokens):
    seq = Sequence(str(request_id), None, prompt, SamplingParams(max_tokens=max_tokens), 0,
                   NullDetokenizer())
    sched.add(seq)
    return seq


def run(sched, runner, max_steps=10_000):
    finish_order = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finish_order
        batch = sched.schedule()
        tokens = runner.execute(batch.forward_batch(sched.block_manager.block_size),
                                batch.sampling_batch()) if batch else None
        finish_order += [s.request_id for s in sched.postprocess(batch, tokens) if s.is_finished]
    raise AssertionError("scheduler did not finish")


def random_prompts(n, seed=0, lo=1, hi=30):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, 1000, rng.integers(lo, hi))) for _ in range(n)]


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_preemption_keeps_every_request_exact_and_leaks_nothing(scheduling):
    sched, bm, runner = setup(num_blocks=24, block_size=4, max_num_seqs=8, scheduling=scheduling)
    prompts = random_prompts(20)
    seqs = [add(sched, i, p, 6 + i % 9) for i, p in enumerate(prompts)]
    run(sched, runner)
    assert sched.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.status is SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == alone(prompt, seq.params.max_tokens), seq.request_id
    assert bm.num_free_blocks == 24 and not sched.running and not sched.waiting


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_steps_stay_within_budgets(scheduling):
    sched, _, runner = setup(num_blocks=200, max_num_seqs=3, max_num_batched_tokens=10, scheduling=scheduling)
    for i in range(7):
        add(sched, i, [5] * 4, 3)
    run(sched, runner)
    for is_prefill, num_seqs, num_tokens in runner.batches:
        assert num_seqs <= 3 and num_tokens <= 10
        if not is_prefill:
            assert num_tokens == num_seqs
    if scheduling == "static":
        assert runner.batches[0] == (True, 2, 8)      # a third 4-token prompt would exceed 10: not chunked
    else:
        assert runner.batches[0] == (True, 3, 10)     # ... chunked: its first 2 tokens


def test_fifo_admission_and_finish_order():
    sched, _, runner = setup(max_num_seqs=2)
    seqs = [add(sched, i, [3, 4, 5], 4) for i in range(6)]
    assert run(sched, runner) == [str(i) for i in range(6)]
    firsts = [s.first_token_time for s in seqs]
    assert firsts == sorted(firsts)


def test_preempted_sequence_goes_back_to_the_front():
    sched, bm, runner = setup(num_blocks=6, block_size=4, max_num_seqs=2)
    a, b = add(sched, "a", [1] * 7, 15), add(sched, "b", [2] * 7, 15)
    c = add(sched, "c", [3] * 3, 2)
    for _ in range(20):     # a and b both grow; at their 4th block only a gets one
        batch = sched.schedule()
        sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
        if b.num_preemptions:
            break
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b, c] and b.block_table == []
    run(sched, runner)
    assert a.output_token_ids == alone([1] * 7, 15) and b.output_token_ids == alone([2] * 7, 15)
    assert bm.num_free_blocks == 6


def test_static_scheduling_admits_only_when_nothing_runs():
    sched, _, runner = setup(max_num_seqs=2, scheduling="static")
    for i in range(5):
        add(sched, i, [7, 8], 2 + 3 * (i % 2))   # batch mates finish at different times
    run(sched, runner)
    prefills = [i for i, (is_prefill, _, _) in enumerate(runner.batches) if is_prefill]
    # batch of 2 runs 5 tokens (prefill + 4 decodes) before the next prefill
    assert prefills == [0, 5, 10]


def test_static_scheduling_prefills_a_long_prompt_in_chunks_alone():
    sched, bm, runner = setup(max_num_batched_tokens=8, scheduling="static")
    long_seq = add(sched, "long", list(range(1, 26)), 3)
    short = add(sched, "short", [9, 9], 3)
    run(sched, runner)
    assert runner.batches[:4] == [(True, 1, 8), (True, 1, 8), (True, 1, 8), (True, 2, 3)]
    assert long_seq.output_token_ids == alone(list(range(1, 26)), 3)
    assert short.output_token_ids == alone([9, 9], 3)
    assert bm.num_free_blocks == 64


def test_a_sequence_that_outgrows_the_whole_cache_finishes_with_length():
    sched, bm, runner = setup(num_blocks=4, block_size=4)
    seq = add(sched, "x", [1] * 10, 100)
    run(sched, runner)
    # 16 slots: 10 prompt tokens + 6 decoded ones fill the cache, the 7th sampled token ends it
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 7
    assert seq.output_token_ids == alone([1] * 10, 7) and bm.num_free_blocks == 4


def test_context_limit_finishes_with_length():
    sched, _, runner = setup(context_limit=12)
    seq = add(sched, "x", [1] * 10, 100)
    run(sched, runner)
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 12


def test_abort_frees_blocks_and_is_reported_once():
    sched, bm, runner = setup()
    a, b = add(sched, "a", [1] * 9, 50), add(sched, "b", [2] * 5, 3)
    batch = sched.schedule()
    sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    free_before = bm.num_free_blocks
    sched.abort(a)
    assert bm.num_free_blocks == free_before + 3 and a.status is SequenceStatus.FINISHED_ABORTED
    batch = sched.schedule()
    reported = sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    assert a in reported and [s.request_id for s in batch.seqs] == ["b"]
    run(sched, runner)
    assert b.output_token_ids == alone([2] * 5, 3) and bm.num_free_blocks == 64
