"""Cascade (shared-prefix) decode attention: which prefix a decode batch shares and when it is
used (engine/batch.py), the numpy twin against paged_attention (reference/cascade.py), and the
numpy engine taking it end to end with the tokens it gives without it."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.engine import batch as batch_module
from tinyvllm.engine.batch import ForwardBatch, cascade_prefix_blocks, common_prefix_blocks
from tinyvllm.engine.llm import LLM
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.reference.cascade import (
    attention_partial,
    cascade_paged_attention,
    merge_attention_partials,
    prefix_partial,
)
from tinyvllm.reference.kernels import gather_kv, paged_attention
from tinyvllm.trace import TWIN_OF, batch_lines

U = 2.0 ** -24                   # float32's unit roundoff
EXP_ERROR = 6 * U                # numpy's float32 exp: 3 ulps (below)


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


# ---- which prefix, and when -------------------------------------------------------------------

def test_common_prefix_counts_shared_full_blocks_before_each_newest_token():
    bs = 4
    tables = np.array([[5, 9, 2, 7, 1], [5, 9, 2, 8, 3], [5, 9, 2, 7, 4]], np.int32)
    # the fourth column differs (7, 8, 7): three blocks are common, given contexts long enough
    assert common_prefix_blocks(tables, [20, 20, 20], bs) == 3
    # the newest token (position ctx - 1) must lie after the prefix: ctx 13 puts it at 12, the
    # first slot of block 3, so 3 blocks; ctx 12 puts it in block 2, the last of the three
    assert common_prefix_blocks(tables, [20, 13, 20], bs) == 3
    assert common_prefix_blocks(tables, [20, 12, 20], bs) == 2
    assert common_prefix_blocks(tables, [20, 5, 20], bs) == 1
    assert common_prefix_blocks(tables, [20, 4, 20], bs) == 0      # its block 0 takes the new row
    same = np.tile(np.array([[5, 9, 2, 7, -1]], np.int32), (3, 1))
    assert common_prefix_blocks(same, [16, 16, 15], bs) == 3         # never a block being written
    assert common_prefix_blocks(same, [17, 17, 17], bs) == 4
    assert common_prefix_blocks(tables[:1], [20], bs) == 4          # one sequence: all it has
    assert common_prefix_blocks(tables[[0, 1]][:, ::-1].copy(), [20, 20], bs) == 0
    assert common_prefix_blocks(np.zeros((0, 1), np.int32), [], bs) == 0


def test_cascade_is_taken_from_the_rules_sequences_and_prefix():
    bs = 16
    blocks = batch_module.CASCADE_MIN_PREFIX_TOKENS // bs
    seqs = batch_module.CASCADE_MIN_SEQS

    def tables(shared, n):
        own = 1000 + np.arange(n * 4, dtype=np.int32).reshape(n, 4)
        return np.concatenate([np.tile(np.arange(shared, dtype=np.int32), (n, 1)), own], axis=1)

    at = (blocks * bs + 1) * np.ones(seqs, np.int32)       # the newest token just after the prefix
    assert cascade_prefix_blocks(tables(blocks, seqs), at, bs) == blocks
    assert cascade_prefix_blocks(tables(blocks, seqs), at - 1, bs) == 0         # one block short complete
    assert cascade_prefix_blocks(tables(blocks - 1, seqs), at + 40, bs) == 0    # one block short shared
    assert cascade_prefix_blocks(tables(blocks, seqs - 1), at[1:], bs) == 0     # one sequence short
    assert cascade_prefix_blocks(tables(blocks + 3, seqs), at + 3 * bs, bs) == blocks + 3


def test_decode_batches_carry_their_cascade_prefix_and_prefill_batches_none(small_cascade_rule):
    bs, n, shared = 16, 8, 17
    own = [[1000 + 4 * i + j for j in range(4)] for i in range(n)]
    tables = [list(range(shared)) + o for o in own]
    ctx = [shared * bs + 1 + 5 * i for i in range(n)]
    width = max(map(len, tables))
    padded = np.array([t + [-1] * (width - len(t)) for t in tables], np.int32)
    fast = ForwardBatch.build_decode(list(range(n)), ctx, padded, bs)
    slow = ForwardBatch.build([[i] for i in range(n)], ctx, tables, bs, is_prefill=False)
    assert fast.common_prefix_blocks == slow.common_prefix_blocks == shared
    assert ForwardBatch.build([[i] for i in range(n)], ctx, tables, bs, is_prefill=True).common_prefix_blocks == 0
    fed = dataclasses.replace(fast, fed_rows=np.arange(n, dtype=np.int32))        # async scheduling's
    assert fed.with_fed_ids(np.zeros(n)).common_prefix_blocks == shared
    assert ForwardBatch.build_decode(list(range(n)), ctx, padded[:, ::-1].copy(), bs).common_prefix_blocks == 0
    # --trace shows the field where it is not 0, and names the twin
    assert any("common_prefix_blocks 17" in line for line in batch_lines(fast))
    assert not any("common_prefix_blocks" in line
                   for line in batch_lines(dataclasses.replace(fast, common_prefix_blocks=0)))
    assert "cascade_paged_attention" in TWIN_OF


# ---- the numpy twin against paged_attention ---------------------------------------------------

def decode_case(rng, hq, hkv, d, bs, prefix_blocks, own_lens):
    """A decode batch whose sequences share their first prefix_blocks physical blocks, then own
    own_lens[i] positions each (0: none), in shuffled physical blocks; every cache slot that no
    sequence holds is NaN, so that reading one would show."""
    own_blocks = [math.ceil(n / bs) for n in own_lens]
    num_blocks = prefix_blocks + sum(own_blocks) + 3
    ids = list(rng.permutation(num_blocks))
    prefix = [ids.pop() for _ in range(prefix_blocks)]
    tables = [prefix + [ids.pop() for _ in range(b)] for b in own_blocks]
    ctx = [prefix_blocks * bs + n for n in own_lens]
    k_cache = np.full((num_blocks, bs, hkv, d), np.nan, np.float32)
    v_cache = k_cache.copy()
    for table, c in zip(tables, ctx):
        for p in range(c):
            k_cache[table[p // bs], p % bs] = rng.standard_normal((hkv, d))
            v_cache[table[p // bs], p % bs] = rng.standard_normal((hkv, d))
    width = max(len(t) for t in tables)
    padded = np.array([t + [-1] * (width - len(t)) for t in tables], np.int32)
    batch = ForwardBatch.build_decode([0] * len(ctx), ctx, padded, bs)
    q = rng.standard_normal((len(ctx), hq, d)).astype(np.float32)
    return q, k_cache, v_cache, batch


def reorder_bound(q, k_cache, v_cache, batch, scale, parts=2) -> float:
    """How far cascade_paged_attention (its key set split into `parts` partials) and
    paged_attention may differ on one decode batch, both computing the same fp32 softmax in
    another order. Per (sequence, query head), exact output o = sum_j w_j v_j with w = softmax(t),
    t_j = sigma q . k_j exactly (sigma = fp32(scale)), n keys. Shift every weight by a common
    constant: o = N / L with N = sum_j e^(t_j - c) v_j, L = sum_j e^(t_j - c).

    Either computation gives N^ / L^ with every term of N and of L perturbed by a relative
    factor (1 + a_j), |a_j| <= eta; then |N^/L^ - o| <= 2 eta V / (1 - eta), V = max_j |v_j|
    (per component: N^ = N + sum_j e^(t_j - c) a_j v_j, L^ = L (1 + b), |b| <= eta, and
    |o| <= V), plus one rounding u V of a final division. The factors, for c = the computed
    global max M^:
      * the score: |s^_j - t_j| <= Delta = gamma_(D+1) sigma sum_d |q_d k_jd| (a D-term dot
        product in any order, Higham 3.1, then the product by sigma): e^(s^_j - M^) is
        e^(t_j - M^) within a factor e^(+-Delta);
      * each exp argument x = s^ - m (m: a partial's max, or m_i - M^ for the merge's rescale)
        is rounded once, |x| <= 2 S with S >= |s^_j|: a factor e^(+-2 S u); the cascade takes
        two such arguments per term (e^(s^_j - m_i), then e^(m_i - M^)), paged_attention one;
      * exp itself: EXP_ERROR relative, numpy's float32 exp held to 3 ulps by numpy's own
        accuracy test (numpy/_core/tests/data/umath-validation-set-exp.csv, ulperrortol 3; an
        ulp is at most 2^-23 of the value) -- twice for the cascade, once for paged_attention;
      * the sums: a float32 sum of n terms in any order (BLAS blocking, numpy's pairwise sum, the
        cascade's prefix-then-own split) is the exact sum of the terms each perturbed by at most
        gamma_n (Higham 3.1 and 4.2). What the cascade reorders is L, a sum of positive terms,
        so its relative error is that of a term: no cancellation to amplify it; N's terms have
        signs, so its error is bounded against sum_j w_j |v_j| <= V instead of |o| (above). The
        cascade's product alpha_i o_i and its `parts - 1` additions of partials add `parts`
        roundings (gamma_(n + parts)); paged_attention's division of each weight by L^ before its
        weighted sum, one (gamma_(n + 1)).
    So eta <= (1 + gamma_(n + parts)) e^(Delta + 4 S u + 2 EXP_ERROR) - 1 for the cascade and
    less for paged_attention, and the two outputs differ by at most
        (4 eta + 2 u) V / (1 - eta).
    It holds for any summation order, so on any BLAS. It assumes no weight underflows (every
    score within 87 of its row's max: checked here), which keeps every relative factor above.
    Taken over the whole batch: the largest n, V, Delta and S of any row."""
    d = q.shape[-1]
    sigma = float(np.float32(scale))
    n = int(batch.context_lens.max())
    abs_dot, v_max = 0.0, 0.0
    for i in range(batch.num_seqs):
        k = np.abs(gather_kv(k_cache, batch.block_tables[i], int(batch.context_lens[i])).astype(np.float64))
        v = gather_kv(v_cache, batch.block_tables[i], int(batch.context_lens[i]))
        group = q.shape[1] // k.shape[1]
        qa = np.abs(q[i].astype(np.float64)).reshape(k.shape[1], group, d)
        abs_dot = max(abs_dot, float(np.einsum("hgd,jhd->hgj", qa, k).max()))
        v_max = max(v_max, float(np.abs(v).max()))
    delta = gamma(d + 1) * sigma * abs_dot
    s = sigma * abs_dot + delta                          # >= every |computed score|
    assert 2 * s < 87, "a weight could underflow: the bound's relative factors would not hold"
    eta = (1 + gamma(n + parts)) * math.exp(delta + 4 * s * U + 2 * EXP_ERROR) - 1
    return (4 * eta + 2 * U) * v_max / (1 - eta)


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (9, 3, 128)])
@pytest.mark.parametrize("prefix_blocks", [0, 1, 7])
def test_cascade_equals_paged_attention(rng, hq, hkv, d, prefix_blocks):
    """Own parts: just the newest token (the prefix is the whole context but it), one that ends
    mid-block, exactly one block, several blocks ending mid-block, random ones, and none at all
    (the prefix is the whole context; not a batch the engine makes, but the maths holds)."""
    bs = 16
    own = [1, 5, 16, 37, *rng.integers(1, 70, 3)] + ([0] if prefix_blocks else [])
    q, k_cache, v_cache, batch = decode_case(rng, hq, hkv, d, bs, prefix_blocks, own)
    scale = d ** -0.5
    want = paged_attention(q, k_cache, v_cache, batch, scale)
    got = cascade_paged_attention(q, k_cache, v_cache, batch, scale, prefix_blocks)
    bound = reorder_bound(q, k_cache, v_cache, batch, scale)
    err = float(np.abs(got - want).max())
    print(f"max |cascade - paged| {err:.3g}, bound {bound:.3g}")
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert err <= bound
    # the engine's own count on such a batch: every shared block before each newest token
    if 0 not in own:
        assert common_prefix_blocks(batch.block_tables, batch.context_lens, bs) == prefix_blocks


def test_prefix_split_partials_merge_like_one(rng):
    """What the GPU kernel will do: the prefix partial of all queries merged with each sequence's
    own context split in two partials (as attention_decode.cu splits a long context)."""
    hq, hkv, d, bs, prefix_blocks = 32, 8, 64, 16, 5
    q, k_cache, v_cache, batch = decode_case(rng, hq, hkv, d, bs, prefix_blocks, [1, 20, 64, 90])
    scale = d ** -0.5
    want = paged_attention(q, k_cache, v_cache, batch, scale)
    prefix = prefix_partial(q, k_cache, v_cache, batch.block_tables[0], prefix_blocks, scale)
    first = prefix_blocks * bs
    halves = []
    for i in range(batch.num_seqs):
        ctx = int(batch.context_lens[i])
        cut = first + (ctx - first) // 2                   # the first half is empty for 1 own token
        k = gather_kv(k_cache, batch.block_tables[i], ctx, first)
        v = gather_kv(v_cache, batch.block_tables[i], ctx, first)
        halves.append([attention_partial(q[i:i + 1], k[a:b], v[a:b], scale)
                       for a, b in ((0, cut - first), (cut - first, ctx - first))])
    split = [tuple(np.concatenate([h[part][j] for h in halves]) for j in range(3)) for part in (0, 1)]
    got = merge_attention_partials(prefix, *split)
    assert np.abs(got - want).max() <= reorder_bound(q, k_cache, v_cache, batch, scale, parts=3)


def test_cascade_refuses_what_is_not_a_shared_decode_prefix(rng):
    q, k_cache, v_cache, batch = decode_case(rng, 4, 2, 8, 4, 2, [3, 6])
    with pytest.raises(ValueError, match="not a prefix common"):
        cascade_paged_attention(q, k_cache, v_cache, batch, 1.0, prefix_blocks=3)     # past ctx 11
    other = batch.block_tables.copy()
    other[1, 1] = other[1, 2]
    with pytest.raises(ValueError, match="not a prefix common"):
        cascade_paged_attention(q, k_cache, v_cache, dataclasses.replace(batch, block_tables=other), 1.0, 2)
    prefill = ForwardBatch.build([[0, 0], [0]], [9, 11], [list(r) for r in batch.block_tables], 4, True)
    with pytest.raises(ValueError, match="decode batches"):
        cascade_paged_attention(np.zeros((3, 4, 8), np.float32), k_cache, v_cache, prefill, 1.0, 2)
    with pytest.raises(ValueError, match="no key"):
        merge_attention_partials(attention_partial(q, k_cache[:0, 0], v_cache[:0, 0], 1.0))


# ---- end to end on the numpy engine -----------------------------------------------------------

GEMMA3 = Path(__file__).parent / "fixtures" / "families" / "gemma3"


def shared_prompt_run(model_dir, prompts, max_tokens):
    """Greedy ids of every prompt, and per step (is_prefill, sequences, common_prefix_blocks,
    the attention twin each layer ran)."""
    llm = LLM(model_dir, device="cpu", num_kv_blocks=256, max_model_len=1024)
    model = llm.engine.runner.model
    calls = []

    def observe(name, args, out):
        if name in ("paged_attention", "cascade_paged_attention"):
            calls.append((name, args[3]))
    model.observer = observe
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens), use_tqdm=False)
    layers = model.config.num_hidden_layers
    steps = []
    for i in range(0, len(calls), layers):
        batch = calls[i][1]
        assert all(b is batch for _, b in calls[i:i + layers])     # one forward's calls, in layer order
        twins = [n for n, _ in calls[i:i + layers]]
        steps.append((batch.is_prefill, batch.num_seqs, batch.common_prefix_blocks, twins))
    return [o.outputs[0].token_ids for o in outs], steps


@pytest.mark.parametrize("model", ["tiny", "gemma3"])
def test_engine_takes_cascade_on_a_shared_prompt_with_the_same_tokens(model, tiny_model_dir, monkeypatch,
                                                                    small_cascade_rule):
    """10 requests sharing a 272-token prompt prefix (17 blocks of 16), then 1..45 tokens of their
    own: prefix caching gives them the same 17 physical blocks, and every decode step of 8 or
    more of them runs cascade attention over those blocks in every layer without a sliding
    window (all of the tiny preset's; one of the Gemma 3 fixture's four, the others per
    sequence), with the greedy tokens of the run with cascade disabled (CASCADE_MIN_SEQS out of
    reach). Request 0 prefills alone and so finishes a step before the others: the last step
    decodes 9."""
    model_dir = tiny_model_dir if model == "tiny" else GEMMA3
    config = LLM(model_dir, device="cpu", num_kv_blocks=8, max_model_len=64).engine.runner.model.config
    rng = np.random.default_rng(5)
    vocab = min(config.vocab_size, 20000)
    shared = list(rng.integers(4, vocab, 272))
    prompts = [shared + list(rng.integers(4, vocab, n)) for n in (1, 3, 7, 15, 16, 17, 30, 45, 2, 9)]
    layers = config.num_hidden_layers
    cascade = ["paged_attention" if config.layer_window(i) else "cascade_paged_attention" for i in range(layers)]
    assert "cascade_paged_attention" in cascade
    with_cascade, steps = shared_prompt_run(model_dir, prompts, 6)
    decode = [s for s in steps if not s[0]]
    assert {s[1] for s in decode} == {10, 9} and all(s[2:] == (17, cascade) for s in decode)
    assert all(s[2:] == (0, ["paged_attention"] * layers) for s in steps if s[0])      # prefill-kind

    monkeypatch.setattr(batch_module, "CASCADE_MIN_SEQS", 1 << 30)
    without, steps_off = shared_prompt_run(model_dir, prompts, 6)
    assert [s[:2] for s in steps_off] == [s[:2] for s in steps]
    assert all(s[2:] == (0, ["paged_attention"] * layers) for s in steps_off)
    assert with_cascade == without
