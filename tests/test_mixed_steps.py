"""Mixed steps (engine/scheduler.py): each step's token budget takes every running decode row
first, then prompt chunks of the waiting sequences. Two levels: the Scheduler with
test_scheduler's FakeRunner (its "model" reads every context token back through the paged cache,
so a wrong slot, block or recompute changes the output), for the step shapes; and the engine on
the numpy backend with the tiny model, where greedy outputs must equal each request run alone
(ReferenceModel.greedy_generate: no batching at all) and those of static scheduling, whose steps
never mix."""
from __future__ import annotations

import numpy as np
import pytest
from test_scheduler import add, alone, random_prompts, setup

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.sequence import SequenceStatus

GREEDY = dict(temperature=0.0, ignore_eos=True)


class StepLog:
    """Wraps a scheduler's schedule() (and, given one, a StepAhead's launches): per step, (is_prefill,
    decode rows, prompt rows with their scheduled token counts). Decode rows are the batch's
    sequences that were running before it was scheduled. `ahead` counts the steps launched
    ahead and the mixed ones among them."""

    def __init__(self, scheduler, step_ahead=None):
        self.steps = []
        self.ahead = self.mixed_ahead = 0
        schedule = scheduler.schedule

        def logged():
            before = set(scheduler.running)
            batch = schedule()
            if batch is not None:
                decode = [s for s in batch.seqs if s in before]
                prompt = [(s, s.num_scheduled_tokens) for s in batch.seqs if s not in before]
                self.steps.append((batch.is_prefill, decode, prompt))
            return batch
        scheduler.schedule = logged
        if step_ahead is not None:
            launch = step_ahead._launch

            def logged_ahead(batch, rows):
                before = set(scheduler.running)
                launched = launch(batch, rows)
                if launched is not None:
                    ahead, _, scheduled = launched
                    decode = [s for s in ahead.seqs if s in before]
                    prompt = [(s, n) for s, n in zip(ahead.seqs, scheduled) if s not in before]
                    self.steps.append((ahead.is_prefill, decode, prompt))
                    self.ahead += 1
                    self.mixed_ahead += bool(decode and prompt)
                return launched
            step_ahead._launch = logged_ahead

    @property
    def num_mixed(self) -> int:
        return sum(bool(decode and prompt) for _, decode, prompt in self.steps)


def drive(sched, runner, arrivals, max_steps=10_000):
    """arrivals: {step number: [(request id, prompt, max_tokens)]}, added before that step."""
    seqs = {}
    for step in range(max_steps):
        for rid, prompt, max_tokens in arrivals.get(step, []):
            seqs[rid] = add(sched, rid, prompt, max_tokens)
        if not sched.has_unfinished() and step > max(arrivals):
            return seqs
        batch = sched.schedule()
        tokens = runner.execute(batch.forward_batch(sched.block_manager.block_size),
                                batch.sampling_batch()) if batch else None
        sched.postprocess(batch, tokens)
    raise AssertionError("scheduler did not finish")


def staggered(prompts, max_tokens, every=2):
    return {every * i: [(str(i), p, m)] for i, (p, m) in enumerate(zip(prompts, max_tokens))}


@pytest.mark.parametrize("num_blocks", [14, 400])        # preempting, roomy
def test_every_step_fits_the_budgets_and_decode_rows_come_first(num_blocks):
    budget, max_seqs = 12, 5
    sched, bm, runner = setup(num_blocks=num_blocks, block_size=4, max_num_seqs=max_seqs,
                              max_num_batched_tokens=budget)
    log = StepLog(sched)
    prompts = random_prompts(16, seed=4, lo=1, hi=40)
    max_tokens = [3 + i % 8 for i in range(16)]
    seqs = drive(sched, runner, staggered(prompts, max_tokens))
    for is_prefill, decode, prompt in log.steps:
        assert len(decode) + len(prompt) <= max_seqs
        assert len(decode) + sum(n for _, n in prompt) <= budget
        assert is_prefill == bool(prompt)           # decode rows only: a decode batch
    assert log.num_mixed > 0
    assert any(n < len(s.prompt_token_ids) and decode for _, decode, prompt in log.steps for s, n in prompt), \
        "a prompt was meant to be chunked beside decode rows"
    assert (sched.num_preemptions > 0) == (num_blocks == 14)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert seqs[str(i)].output_token_ids == alone(p, m), i
    assert bm.num_free_blocks == num_blocks and not sched.running and not sched.waiting


def test_runner_sees_decode_rows_first_oldest_first():
    sched, _, runner = setup(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=16)
    a, b = add(sched, "a", [1] * 3, 10), add(sched, "b", [2] * 3, 10)
    batches = []
    for step in range(6):
        if step == 2:
            c = add(sched, "c", [3] * 20, 4)
        batch = sched.schedule()
        batches.append([s.request_id for s in batch.seqs])
        sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    # a and b decode in every step; c's 20 tokens go in 14 + 6 beside them
    assert batches == [["a", "b"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"]]
    assert c.num_output_tokens == 3 and a.num_output_tokens == b.num_output_tokens == 6
    assert runner.batches[2:4] == [(True, 3, 2 + 14), (True, 3, 2 + 6)]


def test_a_long_prompt_is_not_starved_and_decode_rows_never_wait():
    """Six sequences decoding, then a prompt 10x the budget arrives: every step gives each
    running sequence a token, and the prompt's chunks fill the rest, so it is done in
    ceil(prompt / (budget - running)) steps."""
    budget, running = 16, 6
    sched, _, runner = setup(num_blocks=400, max_num_seqs=8, max_num_batched_tokens=budget)
    decoding = [add(sched, f"d{i}", [10 + i] * 2, 60) for i in range(running)]
    batch = sched.schedule()
    sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    long_prompt = list(range(1, 10 * budget + 1))
    long = add(sched, "long", long_prompt, 5)
    steps = 0
    while long.num_output_tokens == 0:
        before = [s.num_output_tokens for s in decoding]
        batch = sched.schedule()
        sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
        assert [s.num_output_tokens for s in decoding] == [n + 1 for n in before]
        steps += 1
    assert steps == -(-len(long_prompt) // (budget - running))
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    assert long.output_token_ids == alone(long_prompt, 5)
    assert all(s.output_token_ids == alone(s.prompt_token_ids, 60) for s in decoding)


def test_a_prompt_being_chunked_is_preempted_first_and_the_step_admits_nothing():
    """A running sequence needs a block while a chunked prompt holds the rest of the cache: the
    chunked prompt (admitted last) gives its blocks back, not the running one, and that step
    admits no prompt work; both still produce exactly their own tokens."""
    sched, bm, runner = setup(num_blocks=9, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    a = add(sched, "a", [7] * 4, 12)             # its 2nd block at 5 tokens, its 3rd at 9
    batch = sched.schedule()
    sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    b = add(sched, "b", list(range(1, 28)), 2)   # 27 tokens: the other 7 blocks, chunked 5 at a time
    shapes = []
    while b.num_preemptions == 0:
        batch = sched.schedule()
        shapes.append((batch.is_prefill, [s.request_id for s in batch.seqs]))
        sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    assert a.num_preemptions == 0 and a.status is SequenceStatus.RUNNING
    assert shapes[-1] == (False, ["a"]) and b.block_table == [] and list(sched.waiting) == [b]
    assert all(rows == ["a", "b"] for _, rows in shapes[:-1])
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    assert a.output_token_ids == alone([7] * 4, 12) and b.output_token_ids == alone(list(range(1, 28)), 2)
    assert bm.num_free_blocks == 9


def test_prompt_chunks_of_a_mixed_step_are_published_for_the_prefix_cache():
    sched, bm, runner = setup(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    add(sched, "a", [5, 6], 30)
    batch = sched.schedule()
    sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    shared = list(range(100, 124))                       # 6 full blocks
    first = add(sched, "first", shared + [1], 2)
    while first.num_output_tokens == 0:                  # its chunks beside a's decode row
        batch = sched.schedule()
        assert batch.is_prefill and [s.request_id for s in batch.seqs][0] == "a"
        sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    second = add(sched, "second", shared + [2], 2)
    batch = sched.schedule()
    assert second.num_prefix_cached_tokens == 24 and second.num_scheduled_tokens == 1
    sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.postprocess(batch, runner.execute(batch.forward_batch(4), None))
    assert second.output_token_ids == alone(shared + [2], 2) and bm.num_free_blocks == 100


# -- the engine on the numpy backend ----------------------------------------------------------

def engine_prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1000, 100000, rng.integers(2, 45))] for _ in range(n)]


def run_engine(engine, requests, every=2):
    """requests: [(id, prompt, params)], one added every `every` steps -> {id: final output}."""
    log = StepLog(engine.scheduler, engine.step_ahead)
    finals, step, pending = {}, 0, list(requests)
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            engine.add_request(*pending.pop(0))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
        step += 1
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    return finals, log


def mixed_engine(model_dir, **options):
    return LLMEngine(model_dir, **{**dict(device="cpu", block_size=4, max_num_seqs=6, max_num_batched_tokens=16,
                                          max_model_len=64), **options})


@pytest.mark.parametrize("num_kv_blocks", [64, 16])              # roomy, preempting
def test_engine_greedy_with_mixed_steps_equals_each_request_alone(tiny_model_dir, num_kv_blocks):
    prompts, max_tokens = engine_prompts(10), [4 + i % 9 for i in range(10)]
    requests = [(str(i), p, SamplingParams(max_tokens=m, **GREEDY)) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    engine = mixed_engine(tiny_model_dir, num_kv_blocks=num_kv_blocks)
    finals, log = run_engine(engine, requests)
    assert log.num_mixed > 0
    assert (engine.num_preemptions > 0) == (num_kv_blocks == 16)
    static, static_log = run_engine(mixed_engine(tiny_model_dir, num_kv_blocks=num_kv_blocks, scheduling="static"),
                                    requests)
    assert static_log.num_mixed == 0
    reference = engine.runner.model
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert finals[str(i)].token_ids == reference.greedy_generate(p, m), i
        assert finals[str(i)].token_ids == static[str(i)].token_ids, i


def test_engine_async_scheduling_with_mixed_steps_gives_the_sync_outputs(tiny_model_dir):
    """Async scheduling through ModelRunner.launch's default (the step runs when waited for, fed
    ids resolved on the host): steps go ahead, mixed ones (decode rows fed, prompt chunks
    beside them) among them."""
    prompts = engine_prompts(8, seed=2)
    requests = [(str(i), p, SamplingParams(max_tokens=6 + i, **GREEDY)) for i, p in enumerate(prompts)]
    requests += [(f"s{i}", p, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True))
                 for i, p in enumerate(prompts[:3])]
    finals = {}
    for mode in (False, True):
        engine = mixed_engine(tiny_model_dir, num_kv_blocks=64, async_scheduling=mode)
        finals[mode], log = run_engine(engine, requests, every=3)
        assert log.num_mixed > 0
        assert (engine.step_ahead.num_launched > 0) == mode
        assert (log.mixed_ahead > 0) == mode
    assert {k: v.token_ids for k, v in finals[True].items()} == {k: v.token_ids for k, v in finals[False].items()}


def test_engine_seeded_sampling_with_mixed_steps_equals_each_request_alone(tiny_model_dir):
    prompts = engine_prompts(6, seed=5)
    params = [SamplingParams(max_tokens=7, temperature=0.8, top_k=50, seed=100 + i, ignore_eos=True)
              for i in range(6)]
    requests = [(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    finals, log = run_engine(mixed_engine(tiny_model_dir, num_kv_blocks=64), requests)
    assert log.num_mixed > 0
    for rid, prompt, sp in requests:
        alone_engine = mixed_engine(tiny_model_dir, num_kv_blocks=64)
        single, _ = run_engine(alone_engine, [(rid, prompt, sp)])
        assert finals[rid].token_ids == single[rid].token_ids, rid


def test_engine_prefix_caching_with_mixed_steps_keeps_outputs_and_hits(tiny_model_dir):
    system = engine_prompts(1, seed=9)[0][:20] + [7000 + i for i in range(20)]
    tails = engine_prompts(6, seed=10)
    requests = [(str(i), system + t[:5], SamplingParams(max_tokens=6, **GREEDY)) for i, t in enumerate(tails)]
    outs = {}
    for caching in (False, True):
        engine = mixed_engine(tiny_model_dir, num_kv_blocks=80, enable_prefix_caching=caching, max_model_len=80)
        outs[caching], log = run_engine(engine, requests, every=3)
        assert log.num_mixed > 0
    assert engine.prefix_cache_stats.hits >= 5 * 40 - 4 * 5       # the shared 40 tokens, less a block's rounding
    assert {k: v.token_ids for k, v in outs[True].items()} == {k: v.token_ids for k, v in outs[False].items()}


def test_engine_stats_count_prompt_and_generation_tokens_in_mixed_steps(tiny_model_dir):
    engine = mixed_engine(tiny_model_dir, num_kv_blocks=64, enable_prefix_caching=False)
    engine.enable_stats()
    prompts, max_tokens = engine_prompts(5, seed=3), [5, 9, 3, 7, 6]
    log = StepLog(engine.scheduler)
    steps, pending = [], [(str(i), p, SamplingParams(max_tokens=m, **GREEDY))
                          for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    while pending or engine.has_unfinished_requests():
        if pending and len(steps) % 2 == 0:
            engine.add_request(*pending.pop(0))
        engine.step()
        steps.append(engine.last_step_stats)
    assert log.num_mixed > 0
    total = sum(max_tokens)
    assert sum(s.num_generation_tokens for s in steps) == total
    assert sum(s.num_prompt_tokens for s in steps) == sum(len(p) for p in prompts)
    assert sum(s.num_scheduled_tokens for s in steps) == sum(len(p) for p in prompts) + total - len(prompts)
    assert sum(k for s in steps for _, k in s.inter_token_latencies) == total - len(prompts)
    assert all(gap > 0 for s in steps for gap, _ in s.inter_token_latencies)
    assert sum(len(s.time_to_first_tokens) for s in steps) == len(prompts)

