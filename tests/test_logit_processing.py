"""Logit processing (penalties, logit_bias, min_tokens), min_p and raw logprobs on the numpy
side: engine/logit_edits.py builds the sparse LogitEdits, reference/sampling.py applies them. Each
feature is pinned against vLLM's formula written out here, densely over the whole vocabulary,
on hand-made logits (never by calling the twin's own helpers)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyvllm.engine.batch import SamplingBatch
from tinyvllm.engine.logit_edits import LogitEdits, SequenceEdits
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.sequence import Sequence
from tinyvllm.errors import InvalidRequestError
from tinyvllm.reference.sampling import apply_edits, random_bits24, sample, sample_row, sample_step, step_logprobs

V = 64
EOS = (2, 60)
F32 = np.float32


def seq(prompt, output, **params) -> Sequence:
    s = Sequence("r", None, prompt, SamplingParams(max_tokens=100, **params).validate(), seed=7,
                 detokenizer=None)
    s.token_ids.extend(output)
    return s


def vllm_processed(logits, prompt, output, p: SamplingParams, eos=EOS) -> np.ndarray:
    """vLLM V1's processing of one row, dense, in its order: min_tokens, logit_bias, then
    apply_penalties (repetition over prompt + output, then frequency, then presence over the
    output), all in fp32 as vLLM's float32 logits are."""
    x = np.array(logits, F32)
    vocab = len(x)
    if len(output) < p.min_tokens:
        banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos))
        x[sorted(banned)] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += F32(b)
    seen = np.zeros(vocab, bool)
    seen[list(prompt) + list(output)] = True
    rep = np.where(seen, F32(p.repetition_penalty), F32(1))
    x = np.where(x > 0, x / rep, x * rep).astype(F32)
    counts = np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(F32)
    x = x - F32(p.frequency_penalty) * counts
    x = x - F32(p.presence_penalty) * (counts > 0).astype(F32)
    return x


def processed(logits, seqs) -> np.ndarray:
    batch = SamplingBatch.from_sequences(seqs, EOS)
    return apply_edits(np.array(logits, F32), batch.edits)


@pytest.fixture
def logits():
    x = np.random.default_rng(3).standard_normal((1, V)).astype(F32) * 3
    x[0, :8] = [4.0, -3.0, 2.5, 0.0, -0.5, 1.0, 6.0, -6.0]     # both signs, and an exact zero
    return x


PROMPT, OUTPUT = [5, 6, 7, 1, 1, 40], [6, 6, 3, 9, 1, 6, 41]


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=0.8),
    dict(presence_penalty=-1.5),
    dict(frequency_penalty=0.45),
    dict(frequency_penalty=-0.3),
    dict(logit_bias={0: -100.0, 6: 3.5, 50: 2.25}),
    dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={6: 1.0, 12: -2.0}),
    dict(min_tokens=10, stop_token_ids=[33]),
    dict(min_tokens=10, stop_token_ids=[33], ignore_eos=True),
    dict(min_tokens=7, stop_token_ids=[33]),            # reached: nothing banned
    dict(min_tokens=10, logit_bias={2: 5.0}, repetition_penalty=1.5, frequency_penalty=0.1),
])
def test_each_feature_matches_vllm_formula(logits, params):
    s = seq(PROMPT, OUTPUT, **params)
    expected = vllm_processed(logits[0], PROMPT, OUTPUT, s.params)
    got = processed(logits, [s])[0]
    np.testing.assert_array_equal(got, expected)      # the same fp32 operations: bit for bit
    assert not np.array_equal(got, logits[0]) or params.get("min_tokens") == 7


def test_min_tokens_bans_eos_and_stop_ids_until_reached(logits):
    s = seq(PROMPT, [], min_tokens=2, stop_token_ids=[33])
    for n in range(4):
        got = processed(logits, [s])[0]
        banned = np.isneginf(got)
        assert set(np.flatnonzero(banned)) == ({2, 33, 60} if n < 2 else set())
        s.token_ids.append(10 + n)


def test_penalised_greedy_changes_the_argmax(logits):
    x = logits.copy()
    x[0, 6] = 10.0                         # token 6 wins greedy ...
    s = seq(PROMPT, OUTPUT, temperature=0.0, frequency_penalty=2.0)
    plain = sample(x.copy(), SamplingBatch.greedy(1))[0]
    batch = SamplingBatch.from_sequences([s], EOS)
    got = sample(apply_edits(x.copy(), batch.edits), batch)[0]
    expected = int(np.argmax(vllm_processed(x[0], PROMPT, OUTPUT, s.params)))
    assert plain == 6 and got == expected != 6      # ... until generated 3 times at 2.0 each


def test_plain_rows_add_no_entries_and_plain_batches_none():
    plain = [seq([1, 2], [3]), seq([4], [], temperature=0.5, top_p=0.9, min_p=0.1)]
    batch = SamplingBatch.from_sequences(plain, EOS)
    assert batch.edits is None and batch.logprobs is None
    mixed = plain + [seq([1, 2, 3], [4, 4], presence_penalty=1.0)]
    edits = SamplingBatch.from_sequences(mixed, EOS).edits
    assert set(edits.row.tolist()) == {2}
    # rep = 1: only generated tokens can change, so the prompt's are not listed
    assert sorted(edits.token.tolist()) == [4]
    np.testing.assert_array_equal(edits.pres, [1.0])


def test_edits_are_unique_per_row_and_token():
    s = seq([1, 2, 3], [3, 4], repetition_penalty=1.1, logit_bias={3: 1.0, 9: 2.0},
            min_tokens=5, stop_token_ids=[9, 4])
    e = SamplingBatch.from_sequences([s, s], EOS).edits
    pairs = list(zip(e.row.tolist(), e.token.tolist()))
    assert len(pairs) == len(set(pairs)) == 2 * len({1, 2, 3, 4, 9, *EOS})
    packed = e.packed()
    assert packed.shape == (e.num_entries, 8)
    np.testing.assert_array_equal(packed.view(F32)[:, 4], e.rep)


def test_sequence_edits_follow_appends_incrementally():
    s = seq([5, 5, 7] + list(range(200, 230)), [], repetition_penalty=1.5, frequency_penalty=0.5)
    SamplingBatch.from_sequences([s], EOS)
    state = s.sampler_state
    assert isinstance(state, SequenceEdits) and sorted(state.entries[:, 1].tolist()) == [5, 7, *range(200, 230)]
    s.token_ids.extend([7, 8, 8] + list(range(100, 140)))    # forces its entries to grow
    edits = SamplingBatch.from_sequences([seq([1], []), s], EOS).edits
    assert s.sampler_state is state and state.num_output_counted == 43
    assert [state.output_count(t) for t in (5, 7, 8, 139, 99)] == [0, 1, 2, 1, 0]
    by_token = {t: i for i, t in enumerate(edits.token.tolist())}
    assert set(edits.row.tolist()) == {1} and len(by_token) == 2 + 30 + 1 + 40
    assert edits.rep[by_token[5]] == F32(1.5) and edits.freq[by_token[5]] == 0
    assert edits.freq[by_token[8]] == F32(1.0) and edits.rep[by_token[8]] == F32(1.5)


def test_min_tokens_only_rows_drop_out_once_reached():
    s = seq([1], [], min_tokens=1)
    assert SamplingBatch.from_sequences([s], EOS).edits.num_entries == len(EOS)
    s.token_ids.append(9)
    assert SamplingBatch.from_sequences([s], EOS).edits is None and s.sampler_state == "plain"


def test_out_of_vocab_tokens_are_skipped():
    x = np.zeros((1, 8), F32)
    edits = LogitEdits.from_columns(np.zeros(2, np.int32), np.array([3, 99], np.int32), bias=np.full(2, 1.5, F32))
    np.testing.assert_array_equal(apply_edits(x, edits)[0], [0, 0, 0, 1.5, 0, 0, 0, 0])


def test_broken_logits_stay_broken():
    x = np.array([[np.nan, np.inf, 1.0, -np.inf]], F32)
    s = seq([0, 1, 2, 3], [], repetition_penalty=2.0, min_tokens=1, stop_token_ids=[0, 1], ignore_eos=True)
    got = processed(x, [s])[0]
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == 0.5 and got[3] == -np.inf


# -- min_p -------------------------------------------------------------------------------------
def vllm_min_p_token(x, temperature, min_p, top_p, u):
    """vLLM: probs of x / T; drop probs < min_p * max; top-p over what is left (renormalised);
    the inverse CDF at u, in float64. -> (token, distance of u to that token's CDF edges)."""
    z = np.asarray(x, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    p = np.where(p < min_p * p.max(), 0.0, p)
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        cs = np.cumsum(p[order])
        drop = cs - p[order] >= top_p             # tokens entirely beyond the top-p mass
        p[order[drop]] = 0.0
        p /= p.sum()
    cdf = np.cumsum(p)
    token = int(np.searchsorted(cdf, u, side="right"))
    lo = cdf[token - 1] if token else 0.0
    return token, min(u - lo, cdf[token] - u)


@pytest.mark.parametrize("min_p,top_p", [(0.05, 1.0), (0.3, 1.0), (0.6, 1.0), (0.1, 0.8), (1.0, 1.0)])
def test_min_p_matches_vllm(min_p, top_p):
    # log-probabilities spaced so that no token sits near a min_p or top-p edge
    x = np.array([0.0, -0.4, -1.0, -1.6, -2.5, -3.3, -4.7, -6.0, -9.0, -20.0], F32)
    kept_seen = set()
    for seed in range(400):
        u = random_bits24(seed, 3) / 2**24
        expected, margin = vllm_min_p_token(x, 1.0, min_p, top_p, u)
        got = sample_row(x, 1.0, -1, top_p, seed, 3, min_p=min_p)
        if margin > 1e-6:                         # float rounding can only matter at an edge
            assert got == expected, (seed, u, got, expected)
        kept_seen.add(got)
    probs = np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum()
    assert max(kept_seen) <= max(np.flatnonzero(probs >= min_p * probs.max()))
    if min_p == 1.0:
        assert kept_seen == {0}                   # only the top token survives


def test_min_p_zero_is_todays_sampler():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 3000)) * 3).astype(F32)
    args = ([0.9] * 6, [-1, 40, -1, 5, -1, 100], [1.0, 1.0, 0.9, 0.5, 0.95, 0.7], range(6), [4] * 6)
    a = sample(x.copy(), SamplingBatch.build(*args))
    b = sample(x.copy(), SamplingBatch.build(*args, min_p=[0.0] * 6))
    np.testing.assert_array_equal(a, b)


def test_min_p_is_argmax_invariant_for_greedy():
    x = np.array([[0.0, 3.0, 2.9, -1.0]], F32)
    batch = SamplingBatch.build([0.0], [-1], [1.0], [0], [0], min_p=[0.99])
    assert sample(x, batch)[0] == 1


# -- logprobs ----------------------------------------------------------------------------------
def log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def ulp(v):
    return np.spacing(np.abs(np.asarray(v, F32))).astype(np.float64)


def test_step_logprobs_against_float64_log_softmax():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((5, 3000)) * 4).astype(F32)
    x[1, 17] = x[1, 2000] = 30.0                 # a tie at the top: lower id first
    x[2, :2990] = -np.inf                         # few finite tokens
    sampled = np.array([0, 2000, 2995, 123, 2999], np.int32)
    k = 20
    lp, rank, top, top_lp = step_logprobs(x, sampled, k)
    ref = log_softmax64(x)
    rows = np.arange(5)
    # fp32(x - fp32(lse)): |error| <= |fp32(lse) - lse| + rounding of the subtraction
    # <= ulp(lse)/2 + ulp(logprob)/2 (float64 lse itself is exact to ~1e-15)
    lse = x.astype(np.float64)[rows, sampled] - ref[rows, sampled]
    bound = ulp(lse) / 2 + ulp(ref[rows, sampled]) / 2 + 1e-12
    assert np.all(np.abs(lp - ref[rows, sampled]) <= bound)
    np.testing.assert_array_equal(rank, [(x[r] >= x[r, sampled[r]]).sum() for r in rows])
    assert rank[1] == 2                             # tied with id 17: vLLM counts ">="
    for r in rows:
        order = sorted(range(3000), key=lambda i: (-ref[r, i], i))[:k]
        finite_order = [i for i in order if np.isfinite(ref[r, i])]
        assert top[r].tolist()[:len(finite_order)] == finite_order
        np.testing.assert_allclose(top_lp[r], ref[r, top[r]], rtol=0, atol=float(ulp(30.0)) + 1e-6)
    assert top[1, 0] == 17 and top[1, 1] == 2000
    assert top.dtype == np.int32 and top_lp.dtype == F32 and rank.dtype == np.int32


def test_step_logprobs_k0_and_broken_ids():
    x = np.zeros((2, 10), F32)
    lp, rank, top, top_lp = step_logprobs(x, np.array([-1, 3], np.int32), 0)
    assert top.shape == (2, 0) and top_lp.shape == (2, 0)
    assert math.isnan(lp[0]) and rank[0] == 0
    assert abs(lp[1] - math.log(0.1)) <= float(ulp(math.log(0.1)))
    assert rank[1] == 10                            # all equal: every token is >= it


def test_sample_step_logprobs_are_raw_before_penalties(logits):
    s_plain = seq(PROMPT, OUTPUT, temperature=0.0)
    s_lp = seq(PROMPT, OUTPUT, temperature=0.0, logprobs=3, frequency_penalty=2.0)
    batch = SamplingBatch.from_sequences([s_plain, s_lp], EOS)
    x = np.concatenate([logits, logits])
    ids, out = sample_step(x.copy(), batch)
    assert out is not None and out.rows.tolist() == [1] and out.top_ids.shape == (1, 3)
    ref = log_softmax64(logits[0])
    assert abs(out.sampled_logprob[0] - ref[ids[1]]) <= 1e-5
    assert out.top_ids[0].tolist() == list(np.argsort(-ref, kind="stable")[:3])
    # the penalty moved the sampled token, not the logprobs
    assert ids[1] == int(np.argmax(vllm_processed(logits[0], PROMPT, OUTPUT, s_lp.params)))


def test_no_logprobs_requested_returns_none(logits):
    ids, out = sample_step(logits.copy(), SamplingBatch.greedy(1))
    assert out is None and ids[0] == np.argmax(logits[0])


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", "x"), ("repetition_penalty", 0.0),
    ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 200), ("logit_bias", {1: math.inf}),
    ("logit_bias", {-1: 1.0}), ("logprobs", 21), ("logprobs", -1)])
def test_bad_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(max_tokens=100, **{field: value}).validate()


def test_scheduler_loop_with_penalties_matches_a_dense_vllm_loop(tiny_model_dir):
    """A real step loop (Scheduler + NumpyRunner, SamplingBatch.from_sequences each step, so the
    per-sequence counts update incrementally, through prefill and decode) against a loop that
    recomputes the whole context densely (ReferenceModel.forward_full) and applies vLLM's
    formula to the whole vocabulary: the same greedy tokens."""
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import EngineConfig, ModelConfig
    from tinyvllm.engine.block_manager import BlockManager
    from tinyvllm.engine.scheduler import Scheduler
    from tinyvllm.reference.model import ReferenceModel
    from tinyvllm.reference.numpy_runner import NumpyRunner
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_weights(tiny_model_dir, cfg)
    engine = EngineConfig(block_size=16, num_kv_blocks=64, device="cpu", max_num_seqs=4, max_model_len=256)
    runner = NumpyRunner(cfg, weights, engine)
    eos = (cfg.vocab_size - 1,)
    from tinyvllm.engine.output_processor import OutputProcessor
    sched = Scheduler(engine, BlockManager(64, 16), OutputProcessor(None, eos, 256))
    rng = np.random.default_rng(0)
    all_params = [dict(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.4),
                  dict(temperature=0.0),
                  dict(temperature=0.0, logit_bias={7: 100.0}, min_tokens=3, frequency_penalty=2.0)]
    seqs = []
    for i, kw in enumerate(all_params):
        prompt = rng.integers(0, cfg.vocab_size - 1, 12 + 5 * i).tolist()
        s = Sequence(str(i), None, prompt, SamplingParams(max_tokens=8, **kw).validate(), seed=i,
                     detokenizer=None)
        sched.add(s)
        seqs.append(s)
    lp_rows_seen = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        sampling = SamplingBatch.from_sequences(batch.seqs, eos)
        tokens = runner.execute(batch.forward_batch(16), sampling)
        lp_rows_seen += runner.last_logprobs is not None
        sched.postprocess(batch, tokens)
    assert lp_rows_seen == 0
    model = ReferenceModel(cfg, weights)

    def dense(s, params):
        ctx, out = list(s.prompt_token_ids), []
        for _ in range(8):
            x = vllm_processed(model.forward_full(ctx)[-1], s.prompt_token_ids, out, params, eos=eos)
            t = int(np.argmax(x))
            ctx.append(t)
            out.append(t)
            if t in eos:
                break
        return out

    for s in seqs:
        assert s.output_token_ids == dense(s, s.params), s.request_id
    for s in (seqs[0], seqs[2]):        # and the processing did change the text
        assert s.output_token_ids != dense(s, SamplingParams(max_tokens=8, temperature=0.0))
