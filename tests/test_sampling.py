"""The numpy sampling twin (tinyvllm/reference/sampling.py): the definition the CUDA kernel must match."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyvllm.engine.batch import SamplingBatch
from tinyvllm.reference.sampling import exp_weights, mass, random_bits24, sample, sample_row

V = 5000


@pytest.fixture(scope="module")
def logits():
    return (np.random.default_rng(0).standard_normal((8, V)) * 3).astype(np.float32)


def test_greedy_is_argmax_lowest_index_on_ties(logits):
    x = logits.copy()
    x[2, [7, 99]] = 100.0
    got = sample(x, SamplingBatch.greedy(8))
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))
    assert got[2] == 7 and got.dtype == np.int32


def test_tiny_temperature_is_greedy(logits):
    batch = SamplingBatch.build([1e-7] * 8, [-1] * 8, [1.0] * 8, range(8), [0] * 8)
    assert batch.all_greedy
    np.testing.assert_array_equal(sample(logits, batch), np.argmax(logits, axis=1))


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (-1, 1e-6), (1, 0.5)])
def test_top_k_1_and_tiny_top_p_are_greedy(logits, top_k, top_p):
    for seed in range(5):
        batch = SamplingBatch.build([1.3] * 8, [top_k] * 8, [top_p] * 8, [seed] * 8, range(8))
        np.testing.assert_array_equal(sample(logits, batch), np.argmax(logits, axis=1))


def test_seeded_draws_are_reproducible_and_depend_on_seed_and_step(logits):
    row = logits[0]
    a = [sample_row(row, 1.0, -1, 1.0, seed=42, step=s) for s in range(20)]
    b = [sample_row(row, 1.0, -1, 1.0, seed=42, step=s) for s in range(20)]
    c = [sample_row(row, 1.0, -1, 1.0, seed=43, step=s) for s in range(20)]
    assert a == b and a != c and len(set(a)) > 1


def test_random_bits_are_uniform_24_bit():
    u = np.array([random_bits24(seed, step) for seed in range(50) for step in range(200)])
    assert u.min() >= 0 and u.max() < 2**24
    hist = np.bincount(u >> 20, minlength=16)          # 16 equal buckets of 10000 draws
    assert np.all(np.abs(hist - 625) < 5 * 25)


def test_exp_weights_match_exp_and_max_is_one(logits):
    for t in (0.3, 1.0, 2.5):
        e = exp_weights(logits[1], t)
        want = np.exp((logits[1].astype(np.float64) - logits[1].max()) / t)
        assert e.max() == 1.0 and e.dtype == np.float32
        # relative error grows with |z| (rounding of z * log2 e): ~1e-7 * |log2 e|
        big = want > 1e-3
        np.testing.assert_allclose(e[big], want[big], rtol=1e-6)
        np.testing.assert_allclose(e, want, rtol=2e-5, atol=1e-37)


def draw_frequencies(x, n, temperature=1.0, top_k=-1, top_p=1.0):
    picks = [sample_row(x, temperature, top_k, top_p, seed=s, step=0) for s in range(n)]
    return np.bincount(picks, minlength=len(x)) / n


def softmax(x, t=1.0):
    z = np.exp((x - x.max()) / t)
    return z / z.sum()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_distribution_matches_probabilities_with_temperature(temperature):
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    freq = draw_frequencies(x, 4000, temperature)
    np.testing.assert_allclose(freq, softmax(x, temperature), atol=0.03)


def test_top_k_and_top_p_renormalise_over_the_kept_set():
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    np.testing.assert_allclose(draw_frequencies(x, 4000, top_k=2), [4 / 7, 3 / 7, 0, 0], atol=0.03)
    # top_p=0.65: {0.4, 0.3} holds 0.7 >= 0.65, the smallest such set
    np.testing.assert_allclose(draw_frequencies(x, 4000, top_p=0.65), [4 / 7, 3 / 7, 0, 0], atol=0.03)
    # thresholds are over the full distribution and combine by max: top_k=3, top_p=0.5 -> 2 kept
    np.testing.assert_allclose(draw_frequencies(x, 4000, top_k=3, top_p=0.5), [4 / 7, 3 / 7, 0, 0],
                               atol=0.03)


def test_top_k_keeps_ties():
    x = np.array([1.0, 3.0, 3.0, 0.0], np.float32)
    freq = draw_frequencies(x, 2000, top_k=1)
    assert freq[1] > 0.4 and freq[2] > 0.4 and freq[0] == freq[3] == 0


def radix_select(keys: np.ndarray, weights: np.ndarray, target: int) -> int:
    """Python emulation of cuda/sampling.cu's radix_select: four 8-bit digit passes."""
    prefix, above = 0, 0
    for shift in (24, 16, 8, 0):
        high = 0 if shift == 24 else (0xFFFFFFFF << (shift + 8)) & 0xFFFFFFFF
        match = (keys & high) == prefix
        hist = np.zeros(256, object)
        np.add.at(hist, (keys[match] >> shift) & 255, weights[match].astype(object))
        for d in range(255, -1, -1):
            if above + hist[d] >= target:
                break
            above += hist[d]
        prefix |= d << shift
    return prefix


@pytest.mark.parametrize("seed", range(4))
def test_kernel_radix_select_equals_sort_based_thresholds(seed):
    """The kernel finds top-k / top-p thresholds by radix select on the float bits of e; check
    that this search gives the same thresholds as the sort-based definition in sampling.py."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(3000) * rng.uniform(0.5, 6)).astype(np.float32)
    x[rng.integers(0, 3000, 50)] = x[5]                 # ties
    e = exp_weights(x, 0.9)
    keys, w = e.view(np.uint32).astype(np.int64), mass(e)
    for k in (1, 2, 17, 500, 2999):
        assert np.uint32(radix_select(keys, np.ones(3000, np.int64), k)).view(np.float32) == \
            np.sort(e)[::-1][k - 1]
    for p in (0.01, 0.3, 0.9, 0.999):
        target = math.ceil(float(np.float32(p)) * float(int(w.sum())))
        order = np.argsort(-e, kind="stable")
        want = e[order[np.searchsorted(np.cumsum(w[order]), target)]]
        assert np.uint32(radix_select(keys, w, target)).view(np.float32) == want


def broken_rows(logits):
    """Rows 1, 3, 5 broken (a NaN, a +inf, nothing finite); row 6 has -inf entries, which are fine."""
    x = logits.copy()
    x[1, 17] = np.nan
    x[3, V - 1] = np.inf
    x[5, :] = -np.inf
    x[6, ::2] = -np.inf
    return x


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_rows_get_minus_one_and_the_others_are_untouched(logits, temperature):
    from tinyvllm.reference.sampling import NON_FINITE
    x = broken_rows(logits)
    batch = SamplingBatch.build([temperature] * 8, [50] * 8, [0.9] * 8, list(range(8)), [3] * 8)
    out = sample(x, batch)
    assert out.dtype == np.int32
    assert [i for i in range(8) if out[i] == NON_FINITE] == [1, 3, 5]
    healthy = [0, 2, 4, 6, 7]
    alone = sample(x[healthy], SamplingBatch.build([temperature] * 5, [50] * 5, [0.9] * 5, healthy, [3] * 5))
    assert out[healthy].tolist() == alone.tolist()
    assert all(0 <= t < V for t in alone) and np.isfinite(x[6, out[6]])


def test_head_argmax_keys_name_the_greedy_token_and_broken_rows():
    """reference.sampling.head_argmax_keys (the decode LM head's keys, common.cuh argmax_key):
    the largest key's high word is the row max's ordered bits and its low word the lowest index
    of that max (np.argmax); rows with a NaN (either sign), a +inf or nothing finite decode as
    broken, as sample() has them; -0 and +0 are one value, the lower index wins."""
    from tinyvllm.reference.sampling import head_argmax_keys, ordered_keys
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((9, 1000)) * 3).astype(np.float32)
    x[1, [5, 700]] = 40.0                                   # tie: 5
    x[2, 300] = np.nan
    x[3, 10] = -np.float32(np.nan)                          # a negative NaN is still the largest key
    x[4, 20] = np.inf
    x[5, :] = -np.inf
    x[6, :] = -1.0
    x[6, [3, 9]] = [-0.0, 0.0]                              # -0 == +0: index 3
    x[7, :] = np.float32(-3e38)
    keys = head_argmax_keys(x)
    high, index = (keys >> np.uint64(32)).astype(np.uint32), (np.uint64(0xFFFFFFFF) - (keys & np.uint64(0xFFFFFFFF)))
    pos_inf_key, neg_inf_key = ordered_keys(np.float32([np.inf, -np.inf]))
    broken = (high >= pos_inf_key) | (high <= neg_inf_key)
    assert broken.tolist() == [False, False, True, True, True, True, False, False, False]
    ok = ~broken
    np.testing.assert_array_equal(index[ok], np.argmax(x[ok], axis=-1))
    assert index[1] == 5 and index[6] == 3
    np.testing.assert_array_equal(broken, ~np.isfinite(x.max(axis=-1)) | np.isnan(x).any(axis=-1))
