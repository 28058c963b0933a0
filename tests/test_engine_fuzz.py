"""Property test of LLMEngine (device="cpu"): hypothesis drives random sequences of adds
(greedy, sampled, with stop strings, with injected faults), invalid adds, aborts (a client that
disconnects is an abort to the engine) and steps against a KV cache of 10 blocks of 4 tokens, small enough
that preemption and chunked prefill happen all the time. Two models: ContextHashRunner (the next
token is a hash of the context read back through the paged cache: fast, so many examples) and
the real numpy model (few examples, prompts from a small pool so its reference runs are cached).
After every rule:
  - every KV block is either free or held by live sequences' block tables, its reference count
    the number of tables holding it; a block in more than one table (prefix caching shares them)
    is published and lies wholly below every holder's computed tokens, so no holder writes it;
    each table's copy in BlockManager.tables matches it; with no request unfinished, every
    block is free;
  - each request is reported finished exactly once, and nothing is reported after that;
  - a greedy request that ran to its end has exactly the tokens of the reference model run
    alone, whatever preemptions, chunks and neighbours it went through; an aborted one a
    prefix of them; a faulty one finishes with "error" and never disturbs the others.
Examples (CI-sized): HASH_EXAMPLES state machines of up to FUZZ_STEPS rules on the hash model,
NUMPY_EXAMPLES of up to NUMPY_STEPS rules on the numpy model."""
from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np
import pytest
from fake_runners import POISONED_SEED, ContextHashRunner, NaNRunner, hash_generate

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test  # noqa: E402

from tinyvllm.engine.llm_engine import LLMEngine  # noqa: E402
from tinyvllm.engine.sampling_params import SamplingParams  # noqa: E402
from tinyvllm.errors import InvalidRequestError  # noqa: E402

HASH_EXAMPLES = 60
FUZZ_STEPS = 40
NUMPY_EXAMPLES = 5
NUMPY_STEPS = 20
CONTEXT = 40
OPTIONS = dict(device="cpu", block_size=4, num_kv_blocks=10, max_model_len=CONTEXT, max_num_seqs=4,
               max_num_batched_tokens=24)
MAX_NEW = 10
KINDS = ["greedy", "greedy", "sampled", "stop", "poisoned", "bad_row"]
STOPS = ["e", " the", "\n"]


def unchecked(**fields) -> SamplingParams:
    """A SamplingParams holding values its constructor refuses (forced in afterwards), so that
    add_request's own check is what is exercised."""
    params = SamplingParams()
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


# requests the engine must refuse without changing at all: (prompt, params)
INVALID = [
    ("x", unchecked(temperature=-1.0)), ("x", unchecked(top_p=0.0)),
    ("x", unchecked(max_tokens=0)), ("x", unchecked(stop=[""])),
    ("x", unchecked(stop_token_ids=[-1])), ("", None), ([], None), ([10**7], None),
    ([5] * CONTEXT, None), (None, None), ([1.5], None), ("lone \udc80 surrogate", None),
]


def check_blocks(engine) -> None:
    bm = engine.block_manager
    seqs = [seq for request in engine._requests.values() for seq in request.seqs]
    ahead = set(engine.step_ahead.launched[0].seqs) if engine.step_ahead.launched is not None else set()
    held = collections.Counter(b for seq in seqs for b in seq.block_table)
    free = set(bm._free)
    assert not free & held.keys(), "a held KV block is in the free queue"
    assert sorted(free | held.keys()) == list(range(bm.num_blocks)), "KV blocks lost or invented"
    for block, holders in held.items():
        assert bm.ref_count(block) == holders, f"block {block}: refcount {bm.ref_count(block)}, {holders} tables"
    for seq in seqs:
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"
        for i, block in enumerate(seq.block_table):
            if held[block] > 1:               # shared: full, computed, never written again
                assert bm._hash[block] is not None, f"block {block} is shared but not published"
                assert (i + 1) * bm.block_size <= seq.num_cached_tokens, f"{seq} may write shared block {block}"
    for seq in seqs:
        if seq.is_finished:
            assert not seq.block_table, f"{seq} finished but holds blocks"
        if seq.block_table:
            row = bm.tables[seq.block_table_row]
            assert row[:len(seq.block_table)].tolist() == seq.block_table
            assert (row[len(seq.block_table):] == -1).all()
        # the table covers every token with K/V and at most the tokens the sequence has (one
        # more for a sequence in a step launched ahead: the token it is computing)
        assert -(-seq.num_cached_tokens // bm.block_size) <= len(seq.block_table) <= \
            -(-(seq.num_tokens + (seq in ahead)) // bm.block_size)
    if not engine.has_unfinished_requests():
        assert bm.num_free_blocks == bm.num_blocks, "blocks leaked while idle"


class EngineMachine(RuleBasedStateMachine):
    # set by each test: one engine for every example (it is idle between), the prompts to draw
    # from, and prompt tuple -> the MAX_NEW greedy tokens of the same model run alone
    engine: LLMEngine = None
    prompts = st.lists(st.integers(1000, 100000), min_size=1, max_size=32)
    greedy = None
    outcomes: collections.Counter = collections.Counter()      # (kind, finish_reason) over all examples

    def __init__(self):
        super().__init__()
        self.live: dict[str, tuple] = {}          # request id -> (prompt, kind, max_tokens, aborted)
        self.finished: set[str] = set()
        self.next_id = 0

    @rule(data=st.data(), count=st.integers(1, 4))
    def add(self, data, count):
        for _ in range(count):
            self.add_one(data.draw(self.prompts), data.draw(st.integers(1, MAX_NEW)),
                         data.draw(st.sampled_from(KINDS)), data.draw(st.integers(0, 2**64 - 1)))

    def add_one(self, prompt, max_tokens, kind, seed):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        params = {"greedy": SamplingParams(**greedy),
                  "stop": SamplingParams(**greedy, stop=STOPS),
                  "sampled": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=seed,
                                            max_tokens=max_tokens, ignore_eos=True),
                  "poisoned": SamplingParams(temperature=0.7, seed=POISONED_SEED, max_tokens=max_tokens),
                  "bad_row": SamplingParams(**greedy)}[kind]
        if kind == "sampled" and seed == POISONED_SEED:
            params = dataclasses.replace(params, seed=seed + 1)     # SamplingParams is frozen
        self.engine.add_request(request_id, prompt, params)
        if kind == "bad_row":          # a value past admission that no int32 array holds
            object.__setattr__(self.engine._requests[request_id].params, "top_k", 2**31)
        self.live[request_id] = (prompt, kind, max_tokens, False)

    @rule(case=st.sampled_from(INVALID), reuse_id=st.booleans())
    def add_invalid(self, case, reuse_id):
        before = (dict(self.engine._requests), self.engine.num_free_blocks)
        request_id = next(iter(self.live)) if reuse_id and self.live else "invalid"
        prompt, params = case
        with pytest.raises(InvalidRequestError):
            self.engine.add_request(request_id, prompt, params)
        if reuse_id and self.live:      # a valid request under an id in use
            with pytest.raises(InvalidRequestError, match="already in use"):
                self.engine.add_request(request_id, "Hello", None)
        assert (dict(self.engine._requests), self.engine.num_free_blocks) == before

    # The draw's bounds depend on the rules' own history (next_id), never on which requests the
    # engine has finished: the engine outlives each example, so a strategy built from `live`
    # could draw differently when hypothesis replays a choice sequence (FlakyStrategyDefinition).
    @precondition(lambda self: self.next_id > 0)
    @rule(data=st.data())
    def abort(self, data):
        pick = data.draw(st.integers(0, self.next_id - 1))
        if not self.live:
            return
        live = sorted(self.live)
        request_id = live[pick % len(live)]
        self.engine.abort_request(request_id)
        prompt, kind, max_tokens, _ = self.live[request_id]
        self.live[request_id] = (prompt, kind, max_tokens, True)

    @rule()
    def abort_unknown(self):
        self.engine.abort_request("no-such-request")

    @rule(n=st.integers(1, 8))
    def step(self, n):
        for _ in range(n):
            for out in self.engine.step():
                self.record(out)
            check_blocks(self.engine)

    def record(self, out) -> None:
        assert out.request_id in self.live, f"{out.request_id} reported after it finished"
        if not out.finished:
            return
        prompt, kind, max_tokens, aborted = self.live.pop(out.request_id)
        self.finished.add(out.request_id)
        room = min(max_tokens, CONTEXT - len(prompt))
        out = out.outputs[0]
        tokens, reason = out.token_ids, out.finish_reason
        self.outcomes[kind, reason] += 1
        assert all(0 <= t < self.engine.model_config.vocab_size for t in tokens)
        if kind in ("poisoned", "bad_row"):
            assert reason == "error" or (aborted and reason == "abort"), (kind, reason)
            assert reason != "error" or out.error
            return
        assert out.error is None
        if aborted and reason == "abort":
            assert len(tokens) <= room
        elif kind == "stop":
            assert reason in ("stop", "length") and not any(s in out.text for s in STOPS)
        else:
            assert reason == "length" and len(tokens) == room, (kind, reason, len(tokens), room)
        if kind in ("greedy", "stop"):
            expected = self.greedy(tuple(prompt))
            assert tokens == expected[:len(tokens)], "greedy tokens differ from the model run alone"

    @invariant()
    def blocks_accounted(self):
        check_blocks(self.engine)

    def teardown(self):
        for _ in range(1000):                 # let whatever is live finish
            if not self.engine.has_unfinished_requests():
                break
            for out in self.engine.step():
                self.record(out)
        assert not self.live and not self.engine.has_unfinished_requests()
        check_blocks(self.engine)
        assert self.engine.dead is None


def run_machine(engine, prompts, greedy, examples, steps=FUZZ_STEPS, preemptions=True, derandomize=False) -> None:
    """derandomize: the same draws on every run and machine (hypothesis' fixed seed), for a run of
    so few examples that random draws may miss an outcome asserted below."""
    EngineMachine.engine, EngineMachine.prompts, EngineMachine.greedy = engine, prompts, staticmethod(greedy)
    EngineMachine.outcomes = collections.Counter()
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=derandomize,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    print(f"{examples} examples, {engine.num_preemptions} preemptions, outcomes "
          f"{dict(sorted(EngineMachine.outcomes.items()))}")
    assert engine.num_preemptions > 0 or not preemptions, "the cache was meant to be too small to avoid preemption"
    assert EngineMachine.outcomes["greedy", "length"]
    assert engine.num_free_blocks == engine.block_manager.num_blocks
    assert np.all(engine.block_manager.tables == -1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fuzzed_engine_over_the_context_hash_model(tiny_model_dir, async_scheduling):
    runner = ContextHashRunner(OPTIONS["num_kv_blocks"], OPTIONS["block_size"])
    engine = LLMEngine(tiny_model_dir, runner=runner, **OPTIONS, async_scheduling=async_scheduling)
    run_machine(engine, EngineMachine.prompts, lambda prompt: hash_generate(prompt, MAX_NEW), HASH_EXAMPLES)
    print(f"async scheduling {async_scheduling}: {engine.step_ahead.num_launched} steps launched ahead, "
          f"{engine.step_ahead.num_rows_thrown_away} rows thrown away")
    assert (engine.step_ahead.num_launched > 0) == async_scheduling


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fuzzed_engine_over_the_numpy_model(tiny_model_dir, async_scheduling):
    base = LLMEngine(tiny_model_dir, **OPTIONS)
    engine = LLMEngine(tiny_model_dir, runner=NaNRunner(base.runner), **OPTIONS, async_scheduling=async_scheduling)
    rng = np.random.default_rng(0)
    pool = [[int(t) for t in rng.integers(1000, 100000, n)] for n in (1, 5, 13, 22, 31)]
    model = base.runner.model
    greedy = functools.lru_cache(maxsize=None)(lambda prompt: model.greedy_generate(list(prompt), MAX_NEW))
    # few and mostly small examples (hypothesis starts small): preemption is the hash model's part.
    # Fixed draws: five random examples can finish no greedy request by length (seen in CI,
    # 2026-12-05, 01144a7), which the outcome check in run_machine rightly calls a vacuous run.
    run_machine(engine, st.sampled_from(pool), greedy, NUMPY_EXAMPLES, NUMPY_STEPS, preemptions=False,
                derandomize=True)
