"""GPU sampler (cuda/sampling.cu through its launcher, GpuOps.sample) against its numpy
twin (tinyvllm/reference/sampling.py) on fresh random logits, with the output buffer poisoned first."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.engine.batch import SamplingBatch
from tinyvllm.gpu.ops import MAX_ARGMAX_SLICES
from tinyvllm.reference.sampling import exp_weights, head_argmax_keys, mass, random_bits24, sample

pytestmark = pytest.mark.gpu

VOCAB = 128256
POISON = -7


@pytest.fixture(scope="module")
def gpu(gpu_ops):
    import pycuda.driver as drv
    return drv, gpu_ops


# argmax blocks per row: one, an uneven split (and, at vocab 7, empty slices), the most; "head":
# no argmax pass, the keys the decode LM head keeps (reference.sampling.head_argmax_keys) instead
SLICES = [1, 7, MAX_ARGMAX_SLICES, "head"]


def gpu_sample(gpu, logits: np.ndarray, batch: SamplingBatch, slices: int | None = 1) -> np.ndarray:
    """The GPU's ids for these logits. slices > 1 (None: the launcher's sample_slices) splits the
    argmax pass over blocks with a poisoned partials workspace, runs the launch twice on fresh
    copies of the logits (the slice counters must come back to 0 for the second, as graph
    replays need) and requires the same ids from both. slices = "head": the argmax keys of these
    logits (head_argmax_keys, the LM head's twin) in place of the argmax pass, one block per row.
    Every launch also writes its ids into poisoned mapped page-locked memory (out_host, how the
    engine's decode steps bring them to the host), which must then equal `out` exactly."""
    drv, sampler = gpu
    num_seqs, vocab = logits.shape

    def host_copy():
        buf = drv.pagelocked_empty(num_seqs + 1, np.int32, mem_flags=drv.host_alloc_flags.DEVICEMAP)
        buf[:] = POISON
        return buf, int(buf.base.get_device_pointer())

    def check_host_copy(buf, result):
        np.testing.assert_array_equal(np.array(buf), result, err_msg="out_host differs from out")

    dev = {name: drv.to_device(np.ascontiguousarray(a)) for name, a in (
        ("temperature", batch.temperature), ("top_k", batch.top_k), ("top_p", batch.top_p),
        ("seed", batch.seed), ("step", batch.step))}
    if slices == "head":
        keys = drv.to_device(head_argmax_keys(logits))
        dev_logits = drv.to_device(np.ascontiguousarray(logits, np.float32))
        out = drv.to_device(np.full(num_seqs + 1, POISON, np.int32))
        host, host_ptr = host_copy()
        sampler.sample(int(dev_logits), num_seqs, vocab, *(int(dev[n]) for n in ("temperature", "top_k", "top_p",
                       "seed", "step")), int(out), head_argmax=int(keys), out_host=host_ptr)
        drv.Context.synchronize()
        result = drv.from_device(out, (num_seqs + 1,), np.int32)
        assert result[-1] == POISON, "sampler wrote past the last row"
        check_host_copy(host, result)
        return result[:-1]
    sliced = slices is None or slices > 1
    partials = drv.to_device(np.full((num_seqs, MAX_ARGMAX_SLICES, 4), POISON, np.int32)) if sliced else 0
    counters = drv.to_device(np.zeros(num_seqs, np.int32)) if sliced else 0
    results = []
    for _ in range(2 if sliced else 1):
        dev_logits = drv.to_device(np.ascontiguousarray(logits, np.float32))   # non-greedy rows are overwritten
        out = drv.to_device(np.full(num_seqs + 1, POISON, np.int32))           # one extra: must stay poisoned
        host, host_ptr = host_copy()
        sampler.sample(int(dev_logits), num_seqs, vocab,
                       *(int(dev[n]) for n in ("temperature", "top_k", "top_p", "seed", "step")), int(out),
                       argmax_partials=int(partials), slice_counters=int(counters), slices=slices, out_host=host_ptr)
        drv.Context.synchronize()
        result = drv.from_device(out, (num_seqs + 1,), np.int32)
        assert result[-1] == POISON, "sampler wrote past the last row"
        check_host_copy(host, result)
        results.append(result[:-1])
    if sliced:
        assert not drv.from_device(counters, (num_seqs,), np.int32).any(), "slice counters not left at 0"
        np.testing.assert_array_equal(results[0], results[1], err_msg="a second launch gave other ids")
    return results[0]


def random_batch(rng, num_seqs, temperatures, top_ks, top_ps) -> SamplingBatch:
    return SamplingBatch.build(rng.choice(temperatures, num_seqs), rng.choice(top_ks, num_seqs),
                               rng.choice(top_ps, num_seqs), rng.integers(0, 2**63, num_seqs),
                               rng.integers(0, 1000, num_seqs))


def explained_by_boundary(x, params, token, tol=1e-6) -> bool:
    """A GPU token that differs from numpy's is acceptable only if the draw u lies within `tol`
    (as a fraction of the kept mass) of that token's CDF interval, or the token sits on a
    top-k/top-p threshold within rounding: the cases where float exp differences may flip."""
    temperature, top_k, top_p, seed, step = params
    e = exp_weights(x, temperature).astype(np.float64)
    w = mass(e.astype(np.float32)).astype(np.float64)
    order = np.sort(e)[::-1]
    tau = 0.0
    if 0 < top_k < len(x):
        tau = order[top_k - 1]
    if top_p < 1:
        cs = np.cumsum(np.sort(w)[::-1])
        tau = max(tau, order[np.searchsorted(cs, np.ceil(np.float32(top_p) * w.sum()))])
    if e[token] < tau * (1 - 1e-5):
        return False
    kept = np.where(e >= tau * (1 - 1e-5), w, 0.0)
    cdf = np.cumsum(kept) / kept.sum()
    u = random_bits24(seed, step) / 2**24
    lo = cdf[token - 1] if token else 0.0
    return lo - tol <= u <= cdf[token] + tol


@pytest.mark.parametrize("slices", SLICES)
def test_greedy_is_exact_argmax_with_ties(gpu, slices):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((33, VOCAB)).astype(np.float32) * 4
    logits[3, [10, 500, 127000]] = 50.0          # ties: lowest index wins
    logits[4, :] = -np.inf
    logits[4, 77] = 0.0
    logits[5, :] = 1.0                           # all equal -> 0
    per_slice = -(-VOCAB // (slices if slices != "head" and slices > 1 else 2))   # ties across a slice boundary
    logits[6, [per_slice - 1, per_slice, VOCAB - 1]] = 60.0
    logits[7, [per_slice, 2 * per_slice - 1]] = 60.0
    batch = SamplingBatch.greedy(33)
    got = gpu_sample(gpu, logits, batch, slices)
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1))
    assert got[3] == 10 and got[4] == 77 and got[5] == 0 and got[6] == per_slice - 1 and got[7] == per_slice


@pytest.mark.parametrize("vocab", [VOCAB, 49152, 50257, 7])
def test_greedy_at_the_launchers_slices(gpu, vocab):
    """Batch 1 and 8 greedy with the workspace and the launcher's own choice of slices
    (sample_slices: 32 for Llama 3's vocabulary, 12 for SmolLM2's): numpy's argmax."""
    rng = np.random.default_rng(vocab)
    for num_seqs in (1, 8):
        logits = (rng.standard_normal((num_seqs, vocab)) * 4).astype(np.float32)
        got = gpu_sample(gpu, logits, SamplingBatch.greedy(num_seqs), slices=None)
        np.testing.assert_array_equal(got, np.argmax(logits, axis=1))


@pytest.mark.parametrize("slices", SLICES)
@pytest.mark.parametrize("vocab", [VOCAB, 1000, 50257, 7])
@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
def test_seeded_sampling_matches_numpy_twin(gpu, vocab, scale, slices):
    rng = np.random.default_rng(int(scale * 1000) + vocab)
    num_seqs = 64
    logits = (rng.standard_normal((num_seqs, vocab)) * scale).astype(np.float32)
    batch = random_batch(rng, num_seqs, [0.0, 0.3, 0.7, 1.0, 1.8],
                         [-1, 0, 1, 2, 40, 1000, vocab + 5], [1.0, 0.95, 0.8, 0.3, 0.01])
    expected = sample(logits.copy(), batch)
    got = gpu_sample(gpu, logits, batch, slices)
    mismatched = np.flatnonzero(got != expected)
    for i in mismatched:
        params = (float(batch.temperature[i]), int(batch.top_k[i]), float(batch.top_p[i]),
                  int(batch.seed[i]), int(batch.step[i]))
        assert batch.temperature[i] > 0, f"greedy row {i} differs"
        assert explained_by_boundary(logits[i], params, int(got[i])), \
            f"row {i} {params}: gpu {got[i]} numpy {expected[i]}"
    assert len(mismatched) <= 1, f"{len(mismatched)} rows differ from the numpy twin"
    assert np.all((got >= 0) & (got < vocab))


def test_sampling_is_deterministic_and_batch_independent(gpu):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((16, VOCAB)) * 3).astype(np.float32)
    batch = random_batch(rng, 16, [0.8, 1.0], [-1, 50], [1.0, 0.9])
    first = gpu_sample(gpu, logits, batch)
    again = gpu_sample(gpu, logits, batch)
    np.testing.assert_array_equal(first, again)
    # Row 5 alone gives the same token as inside the batch.
    alone = SamplingBatch(*(a[5:6] for a in (batch.temperature, batch.top_k, batch.top_p,
                                             batch.seed, batch.step)))
    assert gpu_sample(gpu, logits[5:6], alone)[0] == first[5]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("top_k,top_p,kept", [(-1, 1.0, 8), (3, 1.0, 3), (-1, 0.7, None)])
def test_sampled_frequencies_follow_probabilities(gpu, top_k, top_p, kept):
    n = 4096
    row = np.full(VOCAB, -30.0, np.float32)
    hot = np.array([5, 900, 1234, 40000, 70000, 100000, 128000, 128255])
    row[hot] = [2.0, 1.7, 1.4, 1.0, 0.6, 0.3, 0.0, -0.4]
    logits = np.tile(row, (n, 1))
    batch = SamplingBatch.build([1.0] * n, [top_k] * n, [top_p] * n, np.arange(n) * 7919 + 3, [0] * n)
    got = gpu_sample(gpu, logits, batch)
    probs = np.exp(row[hot] - row[hot].max())
    probs /= probs.sum()
    if kept is None:     # top-p: smallest prefix of the sorted probabilities reaching 0.7
        kept = int(np.searchsorted(np.cumsum(probs), 0.7) + 1)
    probs = probs[:kept] / probs[:kept].sum()
    counts = np.array([(got == t).sum() for t in hot[:kept]])
    assert counts.sum() == n, "sampled a token outside the kept set"
    # 99.9th percentile of chi-square with kept-1 <= 7 degrees of freedom is below 25.
    assert chi_square(counts, probs) < 25.0


@pytest.mark.parametrize("num_seqs,temperature,top_k,top_p", [
    (1, 0.0, -1, 1.0), (1, 0.8, -1, 1.0), (1, 0.8, 50, 0.9), (64, 0.8, 50, 0.9), (256, 0.8, -1, 0.95)])
def test_sampler_time_report(gpu, num_seqs, temperature, top_k, top_p):
    """Prints the kernel's time per call (grep '^[sampler-time]') and checks that every timed
    call produced in-range ids."""
    drv, sampler = gpu
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((num_seqs, VOCAB)) * 3).astype(np.float32)
    batch = SamplingBatch.build([temperature] * num_seqs, [top_k] * num_seqs, [top_p] * num_seqs,
                                range(num_seqs), [0] * num_seqs)
    dev = [drv.to_device(np.ascontiguousarray(a)) for a in (
        logits, batch.temperature, batch.top_k, batch.top_p, batch.seed, batch.step)]
    out = drv.mem_alloc(4 * num_seqs)
    partials = drv.mem_alloc(16 * MAX_ARGMAX_SLICES * num_seqs)    # the engine's workspace
    counters = drv.to_device(np.zeros(num_seqs, np.int32))
    start, end = drv.Event(), drv.Event()
    times = []
    for _ in range(5):
        drv.memcpy_htod(dev[0], logits)            # the kernel overwrites sampled rows
        start.record()
        sampler.sample(int(dev[0]), num_seqs, VOCAB, *map(int, dev[1:]), int(out),
                       argmax_partials=int(partials), slice_counters=int(counters))
        end.record()
        end.synchronize()
        times.append(end.time_since(start) * 1000)
        ids = np.empty(num_seqs, np.int32)
        drv.memcpy_dtoh(ids, out)
        assert ((0 <= ids) & (ids < VOCAB)).all()
    print(f"[sampler-time] S={num_seqs} T={temperature} top_k={top_k} top_p={top_p} "
          f"({sampler.sample_slices(num_seqs, VOCAB)} argmax blocks per row): "
          f"{min(times):.1f} us")


@pytest.mark.parametrize("slices", SLICES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_rows_get_minus_one_on_the_gpu_too(gpu, rng, temperature, slices):
    """Rows with a NaN, a +inf or nothing finite get -1 (the numpy twin's NON_FINITE), never an
    out-of-range id; the other rows (one with -inf entries) are exactly the numpy twin's."""
    from tinyvllm.reference.sampling import NON_FINITE
    x = (rng.standard_normal((8, VOCAB)) * 3).astype(np.float32)
    x[1, int(rng.integers(VOCAB))] = np.nan
    x[3, int(rng.integers(VOCAB))] = np.inf
    x[5, :] = -np.inf
    x[6, ::2] = -np.inf
    batch = SamplingBatch.build([temperature] * 8, [50] * 8, [0.9] * 8, rng.integers(0, 2**63, 8),
                                [3] * 8)
    got, want = gpu_sample(gpu, x.copy(), batch, slices), sample(x, batch)
    assert [i for i in range(8) if got[i] == NON_FINITE] == [1, 3, 5]
    for i in (0, 2, 4, 6, 7):           # the same rule as test_seeded_sampling_matches_numpy_twin
        assert 0 <= got[i] < VOCAB and np.isfinite(x[i, got[i]])
        params = (temperature, 50, 0.9, int(batch.seed[i]), 3)
        assert got[i] == want[i] or (temperature > 0 and explained_by_boundary(x[i], params, int(got[i])))
