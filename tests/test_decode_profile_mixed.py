"""benchmarks/decode_profile.py --mixed on the CPU. mixed_step builds the step the scheduler
builds for ROWS decode rows beside the last chunk of a prompt (decode rows first, each one
token at the end of its context; then the chunk after the prompt's cached tokens), which the
real Scheduler is driven into here for comparison; and the numpy backend runs it on the tiny
model: each row's logits equal those of the same row run in a plain decode batch or as the
chunk alone, and those of a dense recompute, within the fp32 reordering bound of
test_reference, and the step writes K/V exactly at its slot_mapping."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from test_reference import fp32_reorder_bound
from test_scheduler import add, setup

from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.reference.numpy_runner import NumpyRunner

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("decode_profile", ROOT / "benchmarks" / "decode_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("decode_profile", module)
    spec.loader.exec_module(module)
    return module


bench = _bench()


def valid(row) -> list[int]:
    return [int(b) for b in row if b >= 0]


# (rows, context, chunk, prompt_len, block_size): the H100 case; small ones with contexts off
# block boundaries, a chunk that is the whole prompt, one decode row
SHAPES = [(64, 3000, 1984, 4096, 16), (3, 11, 6, 17, 4), (5, 8, 7, 7, 4), (1, 16, 1, 33, 16)]


@pytest.mark.parametrize("rows, context, chunk, prompt_len, block_size", SHAPES)
def test_mixed_step_layout(rows, context, chunk, prompt_len, block_size):
    step = bench.mixed_step(rows, context, chunk, prompt_len, block_size, np.random.default_rng(5))
    m, d, c = step.mixed, step.decode, step.chunk
    assert (m.is_prefill, d.is_prefill, c.is_prefill) == (True, False, True)
    assert (m.num_seqs, m.num_tokens) == (rows + 1, rows + chunk)
    np.testing.assert_array_equal(m.query_start, np.r_[np.arange(rows + 1), rows + chunk])
    np.testing.assert_array_equal(m.context_lens, [context] * rows + [prompt_len])
    np.testing.assert_array_equal(m.positions, np.r_[np.full(rows, context - 1), np.arange(prompt_len - chunk, prompt_len)])
    np.testing.assert_array_equal(m.last_token_indices, np.r_[np.arange(rows), rows + chunk - 1])
    assert m.fed_rows is None and m.common_prefix_blocks == 0 and d.common_prefix_blocks == 0
    for a in (m.token_ids, m.positions, m.slot_mapping, m.query_start, m.context_lens, m.block_tables):
        assert a.dtype == np.int32
    # the parts: the very rows of the mixed step (tokens, positions, slots, tables)
    for name in ("token_ids", "positions", "slot_mapping"):
        np.testing.assert_array_equal(getattr(m, name), np.r_[getattr(d, name), getattr(c, name)], err_msg=name)
    np.testing.assert_array_equal(c.query_start, [0, chunk])
    np.testing.assert_array_equal(c.context_lens, [prompt_len])
    np.testing.assert_array_equal(d.query_start, np.arange(rows + 1))
    # the decode rows are decode_batch's, as the --batch path builds them
    same = bench.decode_batch(rows, context, block_size, np.random.default_rng(5))
    for name in ("token_ids", "positions", "slot_mapping", "context_lens", "block_tables"):
        np.testing.assert_array_equal(getattr(d, name), getattr(same, name), err_msg=name)
    # block tables: whole contexts (the prompt's: the whole prompt), disjoint, inside num_blocks
    per_row, prompt_blocks = -(-context // block_size), -(-prompt_len // block_size)
    assert m.block_tables.shape == (rows + 1, max(per_row, prompt_blocks))
    tables = [valid(r) for r in m.block_tables]
    assert [len(t) for t in tables] == [per_row] * rows + [prompt_blocks]
    assert tables[:rows] == [valid(r) for r in d.block_tables] and tables[rows] == valid(c.block_tables[0])
    every = [b for t in tables for b in t]
    assert len(set(every)) == len(every) and min(every) == 0
    assert step.num_blocks == max(every) + 1 == rows * per_row + prompt_blocks
    # each token's slot is its position in its own row's blocks; no two tokens share one
    seq = np.repeat(np.arange(rows + 1), np.diff(m.query_start))
    for t in range(m.num_tokens):
        p, table = int(m.positions[t]), tables[seq[t]]
        assert m.slot_mapping[t] == table[p // block_size] * block_size + p % block_size
    assert len(set(m.slot_mapping.tolist())) == m.num_tokens
    assert 0 <= m.slot_mapping.min() and m.slot_mapping.max() < step.num_blocks * block_size
    # what the benchmark times as the host's build is this very batch
    again = ForwardBatch.build(*step.build_args, block_size, is_prefill=True)
    for name in ("token_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_tables"):
        np.testing.assert_array_equal(getattr(again, name), getattr(m, name), err_msg=name)


@pytest.mark.parametrize("args", [(0, 10, 4, 8), (2, 0, 4, 8), (2, 10, 0, 8), (2, 10, 9, 8)])
def test_mixed_step_refuses_impossible_shapes(args):
    with pytest.raises(ValueError):
        bench.mixed_step(*args, 16, np.random.default_rng(0))


def test_mixed_step_matches_the_schedulers_step():
    """Drive the Scheduler into the same case: 3 sequences prefilled (prompts of 3) and decoding,
    then a 16-token prompt chunked 8 + 8 beside them with a budget of 3 + 8 tokens. Its third
    step holds the decode rows at context 5 and the prompt's last chunk (8 cached): the same
    rows, order, positions, contexts and table lengths as mixed_step(3, 5, 8, 16); only the
    physical block numbers and token ids differ."""
    rows, chunk, prompt_len, bs = 3, 8, 16, 4
    sched, bm, runner = setup(num_blocks=64, block_size=bs, max_num_seqs=rows + 1,
                              max_num_batched_tokens=rows + chunk)
    for i in range(rows):
        add(sched, f"d{i}", [10 + i] * 3, 50)
    batches = []
    for step in range(3):
        if step == 1:
            add(sched, "prompt", list(range(100, 100 + prompt_len)), 5)
        batch = sched.schedule()
        fb = batch.forward_batch(bs)
        batches.append(fb)
        sched.postprocess(batch, runner.execute(fb, None))
    got = batches[2]
    want = bench.mixed_step(rows, 5, chunk, prompt_len, bs, np.random.default_rng(0)).mixed
    assert got.is_prefill == want.is_prefill
    for name in ("query_start", "positions", "context_lens", "last_token_indices"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.block_tables.shape == want.block_tables.shape
    assert [len(valid(r)) for r in got.block_tables] == [len(valid(r)) for r in want.block_tables]
    assert (got.common_prefix_blocks, got.fed_rows) == (want.common_prefix_blocks, want.fed_rows)


def test_the_numpy_backend_runs_the_mixed_step_as_its_parts(tiny_model_dir):
    rows, context, chunk, prompt_len, bs = 3, 11, 6, 17, 4
    step = bench.mixed_step(rows, context, chunk, prompt_len, bs, np.random.default_rng(7))
    m, d, c = step.mixed, step.decode, step.chunk
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    runner = NumpyRunner(cfg, load_weights(tiny_model_dir, cfg),
                         EngineConfig(device="cpu", block_size=bs, num_kv_blocks=step.num_blocks))
    model = runner.model
    # the cached context: each decode row's first context - 1 tokens, the prompt's first
    # prompt_len - chunk, written through the same tables by one prefill
    rng = np.random.default_rng(8)
    tables = [valid(r) for r in m.block_tables]
    cached = [[int(t) for t in rng.integers(0, 1000, n)] for n in [context - 1] * rows + [prompt_len - chunk]]
    model.forward(ForwardBatch.build(cached, [len(x) for x in cached], tables, bs, is_prefill=True), runner.kv_cache)
    before = runner.kv_cache.copy()

    mixed_logits = model.forward(m, runner.kv_cache)
    mixed_cache, runner.kv_cache = runner.kv_cache, before.copy()
    parts = np.concatenate([model.forward(d, runner.kv_cache), model.forward(c, runner.kv_cache)])
    assert mixed_logits.shape == parts.shape == (rows + 1, cfg.vocab_size)

    # each row against the dense recompute of its whole sequence, and mixed against the parts:
    # both paged, the same sums in other orders (fp32_reorder_bound)
    full = [x + list(new) for x, new in zip(cached, [[t] for t in d.token_ids.tolist()] + [c.token_ids.tolist()])]
    for i, tokens in enumerate(full):
        bound = fp32_reorder_bound(model, model.hidden_full(tokens)[-1:])[0]
        dense = model.forward_full(tokens)[-1]
        for name, got in (("mixed", mixed_logits[i]), ("alone", parts[i])):
            excess = np.abs(got - dense) - bound
            assert excess.max() <= 0, f"row {i} ({name}) beyond the fp32 bound by {excess.max():.3g}"
        excess = np.abs(mixed_logits[i] - parts[i]) - bound
        assert excess.max() <= 0, f"row {i}: mixed vs alone beyond the fp32 bound by {excess.max():.3g}"

    # K/V written exactly at the step's slots (every layer, K and V), the same as by the parts
    def written(cache):
        changed = (cache != before).any(axis=(0, 1, 4, 5)).reshape(-1)     # by slot
        return set(np.flatnonzero(changed).tolist())
    assert written(mixed_cache) == written(runner.kv_cache) == set(m.slot_mapping.tolist())
    np.testing.assert_allclose(mixed_cache, runner.kv_cache, rtol=1e-4, atol=1e-5)

    # and through the runner's own step (forward + sampler): greedy ids are the logits' argmax
    runner.kv_cache = before.copy()
    ids = runner.execute(m, SamplingBatch.greedy(m.num_seqs))
    np.testing.assert_array_equal(ids, mixed_logits.argmax(axis=1))


def test_shared_prefix_decode_batch_shares_only_the_prefix_blocks(small_cascade_rule):
    """--shared-prefix: the first N // block_size blocks are one set of physical blocks in every
    table, every later block is a row's own, and ForwardBatch sees the shared run as a common
    prefix (vLLM's cascade rule, 256 tokens and 8 sequences, met here)."""
    b = bench.decode_batch(8, 300, 16, np.random.default_rng(0), shared_tokens=260)
    tables = b.block_tables
    assert (tables[:, :16] == np.arange(16)).all()
    own = tables[:, 16:19]
    assert len(np.unique(own)) == own.size and own.min() >= 16
    assert b.common_prefix_blocks == 16
    private = bench.decode_batch(8, 300, 16, np.random.default_rng(0))
    assert len(np.unique(private.block_tables)) == private.block_tables.size
