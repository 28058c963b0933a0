"""Prefix caching: hash-chained blocks, reference counts, LRU eviction.

Three levels: the BlockManager alone; the Scheduler with test_scheduler's FakeRunner (its "model"
reads every context token back through the paged cache, so a block shared with the wrong
content changes the output), including a hypothesis property test of random add/step/abort
sequences checked after every step; and the whole engine on the numpy backend, where outputs
with the cache on and off must be byte-identical."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import EOS, FakeRunner, NullDetokenizer, alone

from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager, block_hash
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence, SequenceStatus


def make_seq(request_id, tokens, max_tokens=16):
    return Sequence(str(request_id), None, list(tokens), SamplingParams(max_tokens=max_tokens), 0,
                    NullDetokenizer())


def computed(bm, seq):
    """What a prefill step does to the block manager's view: all tokens computed, then publish."""
    seq.num_cached_tokens = seq.num_tokens
    bm.publish(seq)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """Every block is free xor held; ref counts are the number of tables holding the block; a
    block in two tables is published and lies in the computed part of each; hash maps agree."""
    holders = {}
    for seq in live:
        assert len(seq.block_table) == len(set(seq.block_table)), seq
        if seq.block_table:
            row = bm.tables[seq.block_table_row]
            assert list(row[:len(seq.block_table)]) == seq.block_table and (row[len(seq.block_table):] == -1).all()
        for i, block in enumerate(seq.block_table):
            holders.setdefault(block, []).append((seq, i))
    for block in range(bm.num_blocks):
        ref = bm.ref_count(block)
        assert ref == len(holders.get(block, [])) >= 0, block
        assert (block in bm._free) == (ref == 0), block
        if ref > 1:
            assert bm._hash[block] is not None, f"block {block} shared but not published"
            for seq, i in holders[block]:
                assert (i + 1) * bm.block_size <= seq.num_cached_tokens, f"shared block {block} not computed"
    assert len(bm._free) + len(holders) == bm.num_blocks
    assert {h: b for b, h in enumerate(bm._hash) if h is not None} == bm._published


# -- the block manager alone ------------------------------------------------------------------
def test_hash_chains_over_the_prefix_and_is_stable_across_processes():
    same_tokens = [7, 7, 7, 7]
    first = block_hash(b"", same_tokens)
    assert block_hash(first, same_tokens) != first          # same tokens, another position
    assert block_hash(b"", [7, 7, 7, 8]) != first and block_hash(b"", same_tokens) == first
    code = "from tinyvllm.engine.block_manager import block_hash; print(block_hash(b'', [7, 7, 7, 7]).hex())"
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == first.hex()


def test_a_second_sequence_takes_the_full_blocks_and_never_its_last_token():
    bm = BlockManager(16, block_size=4)
    a = make_seq("a", range(1, 11))                         # 10 tokens: 2 full blocks + 2 tokens
    bm.allocate(a)
    assert bm.cached_prefix(make_seq("x", range(1, 11))) == []      # nothing computed yet
    computed(bm, a)
    assert bm.num_cached_blocks == 2
    b = make_seq("b", [*range(1, 11), 50, 51])
    assert bm.cached_prefix(b) == a.block_table[:2]
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8 == b.num_prefix_cached_tokens
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 1]
    exact = make_seq("c", range(1, 9))                      # 8 tokens = 2 full cached blocks
    assert bm.cached_prefix(exact) == a.block_table[:1]     # the last token must still run
    other = make_seq("d", [1, 2, 3, 9, 5, 6, 7, 8, 9])
    assert bm.cached_prefix(other) == []                    # the chain breaks at block 0
    assert bm.prefix_cache_stats.queries == 10 + 12 and bm.prefix_cache_stats.hits == 8
    check_invariants(bm, [a, b])


def test_freed_blocks_stay_cached_until_the_allocator_needs_them():
    bm = BlockManager(6, block_size=4)
    a = make_seq("a", range(1, 14))                         # 4 blocks, the last one partial
    bm.allocate(a)
    computed(bm, a)
    head = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    # eviction order: never-published blocks first, then published ones tail before head
    assert list(bm._free) == [head[3], 4, 5, head[2], head[1], head[0]]
    b = make_seq("b", [*range(1, 13), 99, 98])
    bm.allocate(b)
    assert b.block_table[:3] == head[:3] and b.num_cached_tokens == 12
    bm.free(b)
    c = make_seq("c", range(100, 120))                      # 5 fresh blocks: evicts 2 cached ones
    bm.allocate(c)
    assert bm.num_cached_blocks == 1 and bm.cached_prefix(make_seq("d", range(1, 14))) == head[:1]
    check_invariants(bm, [c])


def test_shared_block_outlives_one_holder_and_counts_never_go_negative():
    bm = BlockManager(8, block_size=4)
    a, b = make_seq("a", range(1, 10)), make_seq("b", range(1, 10))
    bm.allocate(a)
    computed(bm, a)
    bm.allocate(b)
    shared = a.block_table[:2]
    bm.free(a)
    assert [bm.ref_count(x) for x in shared] == [1, 1] and not set(shared) & set(bm._free)
    impostor = make_seq("impostor", b.token_ids)
    impostor.block_table = list(b.block_table)
    with pytest.raises(RuntimeError, match="does not own"):
        bm.free(impostor)                                 # b's blocks, freed by another sequence
    assert [bm.ref_count(x) for x in b.block_table] == [1, 1, 1]
    check_invariants(bm, [b])


def test_caching_off_shares_nothing_and_counts_nothing():
    bm = BlockManager(8, block_size=4, enable_caching=False)
    a = make_seq("a", range(1, 10))
    bm.allocate(a)
    computed(bm, a)
    b = make_seq("b", range(1, 10))
    assert bm.cached_prefix(b) == [] and bm.num_cached_blocks == 0
    bm.allocate(b)
    assert not set(a.block_table) & set(b.block_table)
    assert bm.prefix_cache_stats.queries == 0 and b.num_cached_tokens == 0


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(8, block_size=4)
    a = make_seq("a", range(1, 10))
    bm.allocate(a)
    computed(bm, a)
    assert not bm.reset_prefix_cache() and bm.num_cached_blocks == 2
    bm.free(a)
    assert bm.reset_prefix_cache() and bm.num_cached_blocks == 0
    assert bm.cached_prefix(make_seq("b", range(1, 10))) == []


# -- the scheduler, with the fake runner that reads its context through the cache -------------
def setup(num_blocks, block_size=4, caching=True, **cfg):
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, device="cpu",
                          enable_prefix_caching=caching, **cfg)
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(config, bm, OutputProcessor(None, (EOS,), 1000)), bm, FakeRunner(num_blocks, block_size)


def live_seqs(sched):
    return [*sched.running, *sched.waiting]


def prompt_tokens(batch) -> int:
    """The prompt positions a step computes (a decode row beside them computes none)."""
    return sum(max(0, min(s.num_cached_tokens + s.num_scheduled_tokens, s.num_prompt_tokens) - s.num_cached_tokens)
               for s in batch.seqs)


def step(sched, runner):
    batch = sched.schedule()
    if batch:
        runner.prompt_tokens = getattr(runner, "prompt_tokens", 0) + prompt_tokens(batch)
    tokens = runner.execute(batch.forward_batch(sched.block_manager.block_size), None) if batch else None
    return sched.postprocess(batch, tokens)


def shared_prefix_prompts(rng, n, num_prefixes=3, prefix_len=(4, 24), suffix_len=(1, 10)):
    prefixes = [list(rng.integers(1, 1000, rng.integers(*prefix_len))) for _ in range(num_prefixes)]
    return [prefixes[rng.integers(num_prefixes)] + list(rng.integers(1, 1000, rng.integers(*suffix_len)))
            for _ in range(n)]


@pytest.mark.parametrize("num_blocks", [12, 40, 400])       # preempting, evicting, roomy
def test_scheduler_outputs_are_exact_and_prefill_computes_less(num_blocks):
    rng = np.random.default_rng(num_blocks)
    prompts = shared_prefix_prompts(rng, 30)
    results = {}
    for caching in (False, True):
        sched, bm, runner = setup(num_blocks, caching=caching, max_num_seqs=6, max_num_batched_tokens=64)
        seqs = [make_seq(i, p, max_tokens=3 + i % 7) for i, p in enumerate(prompts)]
        pending = list(seqs)
        while sched.has_unfinished() or pending:
            for _ in range(2):                                  # requests keep arriving
                if pending:
                    sched.add(pending.pop(0))
            step(sched, runner)
            check_invariants(bm, live_seqs(sched))
        for seq, prompt in zip(seqs, prompts):
            assert seq.output_token_ids == alone(prompt, seq.params.max_tokens), seq.request_id
        assert bm.num_free_blocks == num_blocks
        prefilled = runner.prompt_tokens
        results[caching] = (prefilled, bm.prefix_cache_stats, sched.num_preemptions)
    (off, off_stats, off_preempted), (on, on_stats, on_preempted) = results[False], results[True]
    assert off_stats.queries == 0 and on_stats.hits > 0
    if off_preempted or on_preempted:   # sharing changes what fits: the two recompute differently
        assert on < off
    else:                               # the same schedule: every hit is a token not computed
        assert on == off - on_stats.hits
    assert (on_preempted > 0) == (num_blocks == 12)
    assert (bm.num_evictions > 0) == (num_blocks < 400)


def test_a_burst_sharing_a_prefix_computes_it_once():
    """Requests that arrive together: the first computes the shared blocks, the rest wait one
    step (not computing them too) and then take them from the cache."""
    sched, bm, runner = setup(64, max_num_seqs=8, max_num_batched_tokens=200)
    system = list(range(100, 120))                          # 5 full blocks
    seqs = [make_seq(i, system + [500 + i, 600 + i], max_tokens=3) for i in range(5)]
    unrelated = make_seq("other", [900, 901, 902, 903, 904], max_tokens=3)
    for seq in [*seqs, unrelated]:
        sched.add(seq)
    while sched.has_unfinished():
        step(sched, runner)
    prefills = [(n, t) for is_prefill, n, t in runner.batches if is_prefill]
    assert prefills == [(1, 22), (1 + 5, 1 + 4 * 2 + 5)]     # beside sequence 0's decode row
    assert [s.num_prefix_cached_tokens for s in seqs] == [0, 20, 20, 20, 20]
    for seq in [*seqs, unrelated]:
        assert seq.output_token_ids == alone(seq.prompt_token_ids, 3)


def test_decode_blocks_are_published_so_a_follow_up_turn_hits_them():
    sched, bm, runner = setup(64)
    first = make_seq("turn1", range(1, 7), max_tokens=12)   # 6 + 12 tokens: 4 full blocks
    sched.add(first)
    while sched.has_unfinished():
        step(sched, runner)
    follow_up = make_seq("turn2", [*first.token_ids, 500, 501, 502])
    sched.add(follow_up)
    step(sched, runner)
    # 18 tokens had K/V (the last sampled one never ran): 4 full blocks, 2 of them decode blocks
    assert follow_up.num_prefix_cached_tokens == 16
    assert runner.batches[-1] == (True, 1, len(follow_up.token_ids) - 1 - 16)


def test_abort_of_a_sharing_sequence_keeps_the_other_exact():
    sched, bm, runner = setup(64, max_num_seqs=4)
    prompt = list(range(1, 14))
    a = make_seq("a", prompt, max_tokens=20)
    sched.add(a)
    step(sched, runner)
    b = make_seq("b", prompt + [77], max_tokens=20)
    sched.add(b)
    step(sched, runner)
    assert b.num_prefix_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    sched.abort(a)
    check_invariants(bm, live_seqs(sched))
    assert all(bm.ref_count(x) == 1 for x in b.block_table)
    while sched.has_unfinished():
        step(sched, runner)
    assert b.output_token_ids == alone(prompt + [77], 20)
    assert a.status is SequenceStatus.FINISHED_ABORTED and bm.num_free_blocks == 64


@st.composite
def operations(draw):
    """A few shared prefixes, then adds (a prefix + a suffix), steps and aborts in any order."""
    prefixes = draw(st.lists(st.lists(st.integers(1, 40), min_size=2, max_size=16), min_size=1, max_size=3))
    add = st.tuples(st.just("add"), st.integers(0, len(prefixes) - 1),
                    st.lists(st.integers(1, 40), max_size=6), st.integers(1, 24))
    op = st.one_of(add, add, st.tuples(st.just("step")), st.tuples(st.just("step")),
                   st.tuples(st.just("abort"), st.integers(0, 1000)))
    return prefixes, draw(st.lists(op, min_size=4, max_size=50))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(4, 20), block_size=st.sampled_from([2, 4]), ops=operations())
def test_random_add_step_abort_keeps_every_invariant(num_blocks, block_size, ops):
    prefixes, ops = ops
    sched, bm, runner = setup(num_blocks, block_size, max_num_seqs=6, max_num_batched_tokens=16)
    seqs, aborted = [], set()
    capacity = num_blocks * block_size

    def check():
        check_invariants(bm, live_seqs(sched))
        for seq in live_seqs(sched):
            assert 0 <= seq.num_cached_tokens <= seq.num_tokens

    for op in [*ops, *[("step",)] * 400]:
        if op[0] == "add":
            prompt = prefixes[op[1]] + op[2]
            if len(prompt) < capacity:                    # the engine refuses bigger prompts
                seqs.append(make_seq(len(seqs), prompt, max_tokens=op[3]))
                sched.add(seqs[-1])
        elif op[0] == "abort" and seqs:
            seq = seqs[op[1] % len(seqs)]
            if not seq.is_finished:
                aborted.add(seq.request_id)
            sched.abort(seq)
        elif op[0] == "step":
            step(sched, runner)
        check()
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks and all(bm.ref_count(b) == 0 for b in range(num_blocks))
    for seq in seqs:
        if seq.request_id in aborted:
            continue
        expected = alone(seq.prompt_token_ids, seq.params.max_tokens)
        if seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens < seq.params.max_tokens:
            assert seq.num_tokens > capacity - block_size     # it outgrew the whole cache
            expected = expected[:seq.num_output_tokens]
        assert seq.output_token_ids == expected, seq.request_id


# -- the engine on the numpy backend: byte-identical with the cache on and off ---------------
@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """{caching: engine}, 24 blocks of 4 tokens: small enough to preempt and evict. Each run
    starts from an empty prefix cache."""
    return {caching: LLMEngine(tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=24, max_model_len=96,
                               max_num_seqs=5, max_num_batched_tokens=96, enable_prefix_caching=caching)
            for caching in (False, True)}


def engine_run(engine, requests, aborts=()):
    """requests: [(prompt, params)], added 3 per step; aborts: [(request index, at step)].
    -> ({index: final output}, {"hits", "queries", "preemptions", "evictions"} of this run)."""
    assert engine.reset_prefix_cache()
    stats, bm = engine.prefix_cache_stats, engine.block_manager
    before = (stats.hits, stats.queries, engine.num_preemptions, bm.num_evictions)
    finals, pending, steps = {}, list(enumerate(requests)), 0
    while pending or engine.has_unfinished_requests():
        for _ in range(3):
            if pending:
                i, (prompt, params) = pending.pop(0)
                engine.add_request(str(i), prompt, params)
        for i, at in aborts:
            if at == steps:
                engine.abort_request(str(i))
        for out in engine.step():
            if out.finished:
                finals[int(out.request_id)] = out
        steps += 1
        check_invariants(bm, live_seqs(engine.scheduler))
    assert engine.num_free_blocks == bm.num_blocks
    after = (stats.hits, stats.queries, engine.num_preemptions, bm.num_evictions)
    return finals, dict(zip(("hits", "queries", "preemptions", "evictions"),
                            (a - b for a, b in zip(after, before))))


def chat_like_requests(seed, n):
    """Prompts sharing one of two system prompts, half of them later turns of earlier ones;
    greedy and seeded sampling mixed."""
    rng = np.random.default_rng(seed)
    systems = [[int(t) for t in rng.integers(1000, 100000, rng.integers(9, 30))] for _ in range(2)]
    prompts = []
    for i in range(n):
        base = prompts[rng.integers(len(prompts))] if prompts and i % 2 else systems[i % 4 // 2]
        prompts.append(base + [int(t) for t in rng.integers(1000, 100000, rng.integers(1, 12))])
    params = [SamplingParams(max_tokens=int(rng.integers(2, 9)), ignore_eos=True,
                             **({"temperature": 0.0} if i % 3 else {"temperature": 0.9, "top_k": 50, "seed": i}))
              for i in range(n)]
    return list(zip(prompts, params))


def test_engine_outputs_are_identical_with_the_cache_on_and_off(engines):
    requests = chat_like_requests(4, 12)
    off, off_counts = engine_run(engines[False], requests)
    on, on_counts = engine_run(engines[True], requests)
    for i in range(len(requests)):
        a, b = on[i].outputs[0], off[i].outputs[0]
        assert a.token_ids == b.token_ids and a.text == b.text, f"request {i}"
        assert off[i].num_cached_tokens == 0
    assert off_counts["queries"] == 0 and 0 < on_counts["hits"] < on_counts["queries"]
    assert on_counts["preemptions"] > 0 and on_counts["evictions"] > 0
    assert sum(o.num_cached_tokens for o in on.values()) > 0
    assert all(o.num_cached_tokens % 4 == 0 and o.num_cached_tokens < len(o.prompt_token_ids)
               for o in on.values())


def test_engine_aborts_keep_the_other_outputs_identical(engines):
    """Aborts at fixed steps; the cache changes how far an aborted request got by then, so each
    aborted output is checked as a prefix of the uncut one."""
    requests = chat_like_requests(2, 10)
    aborts = [(1, 2), (4, 3), (6, 4), (8, 6)]
    uncut, _ = engine_run(engines[False], requests)
    cut, counts = engine_run(engines[True], requests, aborts)
    assert sorted(cut) == list(range(10))
    for i, request in cut.items():
        out, whole = request.outputs[0], uncut[i].outputs[0]
        if out.finish_reason == "abort":
            assert out.token_ids == whole.token_ids[:len(out.token_ids)], f"request {i}"
        else:
            assert out.token_ids == whole.token_ids and out.text == whole.text, f"request {i}"
    assert sum(o.outputs[0].finish_reason == "abort" for o in cut.values()) >= 2 and counts["hits"] > 0


def test_engine_option_default_and_reset(tiny_model_dir, engines):
    from tinyvllm.config import EngineConfig
    assert EngineConfig().enable_prefix_caching
    assert engines[True].block_manager.enable_caching and not engines[False].block_manager.enable_caching
    engine = engines[True]
    assert engine.reset_prefix_cache()
    hits_before = engine.prefix_cache_stats.hits
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for request_id in ("a", "b"):                 # the second arrives after the first finished
        engine.add_request(request_id, list(range(1000, 1011)), params)
        while engine.has_unfinished_requests():
            outs = engine.step()
    assert outs[-1].num_cached_tokens == 8 and engine.prefix_cache_stats.hits - hits_before == 8
    engine.add_request("c", list(range(1000, 1011)), params)
    engine.step()
    assert not engine.reset_prefix_cache()        # "c" holds blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() and engine.block_manager.num_cached_blocks == 0
