"""GPU logit processing, min_p and raw logprobs (cuda/sampling.cu's apply_logit_edits,
sample_tokens' min_p, step_logprobs, through their launchers in gpu/ops/sampling.py, and CudaRunner's
optional sampler road) against the numpy twins in reference/sampling.py, on fresh random
logits, with every output buffer poisoned first.

Tolerances:
  * edited logits: bit-exact. Each entry is the same five IEEE fp32 operations (+, /, *, -, -),
    each correctly rounded on both sides (__fadd_rn/__fdiv_rn/__fmul_rn/__fsub_rn vs numpy).
  * sampled ids: exact. After the edits both sides build e_i from identical IEEE ops, and the
    rest (min_p's compare, masses, thresholds, the draw) is integer / compare arithmetic.
  * top ids and ranks: exact (integer keys and >= counts of identical fp32 inputs).
  * logprobs: |gpu - numpy| <= ulp(lse) + ulp(logprob). Both compute lse = fp32(m + log(sum
    exp(x - m))) in float64; the float64 sums differ only in addition order and libm's last bit
    (relative ~1e-15), so the fp32 roundings of lse can differ by at most one ulp(lse); the final
    fp32 subtraction x - lse is then identical up to that ulp plus its own rounding, ulp(logprob).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinyvllm.engine.batch import SamplingBatch
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.sequence import Sequence
from tinyvllm.reference.sampling import apply_edits, sample, sample_step, step_logprobs

pytestmark = pytest.mark.gpu

VOCAB = 128256
EOS = (128001, 128009)


@pytest.fixture(scope="module")
def gpu(gpu_ops):
    import pycuda.driver as drv
    return drv, gpu_ops


def random_sequences(rng, num_seqs: int, vocab: int, plain_fraction=0.5):
    """A mix of plain rows and rows with every kind of processing, random prompts/outputs."""
    seqs = []
    for i in range(num_seqs):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 300))).tolist()
        output = rng.integers(0, vocab, int(rng.integers(0, 60))).tolist()
        output += output[:int(rng.integers(0, 20))]           # repeats: counts above 1
        kw = dict(temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])),
                  top_k=int(rng.choice([-1, 50, 1000])), top_p=float(rng.choice([1.0, 0.9, 0.5])),
                  min_p=float(rng.choice([0.0, 0.0, 0.05, 0.2])))
        if rng.random() >= plain_fraction:
            kw.update(repetition_penalty=float(rng.choice([1.0, 1.1, 0.8, 1.5])),
                      presence_penalty=float(rng.choice([0.0, 0.5, -0.7])),
                      frequency_penalty=float(rng.choice([0.0, 0.3, 1.2])),
                      logit_bias={int(t): float(b) for t, b in zip(rng.integers(0, vocab, 5),
                                                                     rng.uniform(-20, 20, 5))},
                      min_tokens=int(rng.choice([0, len(output) + 1])),
                      stop_token_ids=[int(t) for t in rng.integers(0, vocab, 2)])
        if rng.random() < 0.4:
            kw["logprobs"] = int(rng.choice([0, 1, 5, 20]))
        s = Sequence(f"r{i}", None, prompt, SamplingParams(max_tokens=200, seed=i, **kw).validate(),
                     seed=int(rng.integers(0, 2**63)), detokenizer=None)
        s.token_ids.extend(output)
        seqs.append(s)
    return seqs


def gpu_edit(gpu, logits, batch: SamplingBatch) -> np.ndarray:
    drv, ops = gpu
    dev = drv.to_device(np.ascontiguousarray(logits, np.float32))
    packed = batch.edits.packed()
    edits = drv.to_device(packed)
    ops.apply_logit_edits(int(dev), logits.shape[1], int(edits), batch.edits.num_entries)
    drv.Context.synchronize()
    return drv.from_device(dev, logits.shape, np.float32)


def gpu_sample(gpu, logits, batch: SamplingBatch) -> np.ndarray:
    drv, ops = gpu
    n, vocab = logits.shape
    dev = {name: drv.to_device(np.ascontiguousarray(a)) for name, a in (
        ("logits", logits.astype(np.float32)), ("temperature", batch.temperature), ("top_k", batch.top_k),
        ("top_p", batch.top_p), ("min_p", batch.min_p), ("seed", batch.seed), ("step", batch.step))}
    out = drv.to_device(np.full(n + 1, -7, np.int32))
    ops.sample(int(dev["logits"]), n, vocab, int(dev["temperature"]), int(dev["top_k"]), int(dev["top_p"]),
               int(dev["seed"]), int(dev["step"]), int(out), min_p=int(dev["min_p"]))
    drv.Context.synchronize()
    got = drv.from_device(out, (n + 1,), np.int32)
    assert got[-1] == -7, "sampler wrote past the last row"
    return got[:-1]


def gpu_logprobs(gpu, logits, sampled, k, rows=None):
    """GpuOps.step_logprobs with poisoned outputs (NaN floats, INT_MAX ints) and a guard row."""
    drv, ops = gpu
    n = len(rows) if rows is not None else logits.shape[0]
    dev_x = drv.to_device(np.ascontiguousarray(logits, np.float32))
    dev_s = drv.to_device(np.ascontiguousarray(sampled, np.int32))
    dev_r = drv.to_device(np.asarray(rows, np.int32)) if rows is not None else None
    outs = [drv.to_device(np.full(shape, fill, dtype)) for shape, fill, dtype in (
        (n + 1, np.nan, np.float32), (n + 1, 2**31 - 1, np.int32),
        ((n + 1) * max(k, 1), 2**31 - 1, np.int32), ((n + 1) * max(k, 1), np.nan, np.float32))]
    ops.step_logprobs(int(dev_x), logits.shape[1], n, int(dev_s), k, *map(int, outs),
                      rows=int(dev_r) if dev_r is not None else 0)
    drv.Context.synchronize()
    lp = drv.from_device(outs[0], (n + 1,), np.float32)
    rank = drv.from_device(outs[1], (n + 1,), np.int32)
    top = drv.from_device(outs[2], ((n + 1) * max(k, 1),), np.int32)
    top_lp = drv.from_device(outs[3], ((n + 1) * max(k, 1),), np.float32)
    assert np.isnan(lp[n]) and rank[n] == 2**31 - 1, "step_logprobs wrote past the last row"
    assert np.all(top[n * k:] == 2**31 - 1) and np.all(np.isnan(top_lp[n * k:]))
    return lp[:n], rank[:n], top[:n * k].reshape(n, k), top_lp[:n * k].reshape(n, k)


def ulp(v):
    return np.spacing(np.abs(np.asarray(v, np.float32))).astype(np.float64)


def lse64(x) -> np.ndarray:
    """float64 log-sum-exp of each row: the bound's ulp(lse) is taken of this."""
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1)
    return m + np.log(np.exp(x - m[:, None]).sum(axis=-1))


@pytest.mark.parametrize("seed", [0, 1])
def test_edits_are_bit_exact(gpu, seed):
    rng = np.random.default_rng(seed)
    seqs = random_sequences(rng, 48, VOCAB, plain_fraction=0.3)
    batch = SamplingBatch.from_sequences(seqs, EOS)
    assert batch.edits is not None and batch.edits.num_entries > 1000
    logits = (rng.standard_normal((48, VOCAB)) * 4).astype(np.float32)
    logits[3, :50] = 0.0                                # exact zeros take the "* rep" branch
    expected = apply_edits(logits.copy(), batch.edits)
    np.testing.assert_array_equal(gpu_edit(gpu, logits, batch), expected)
    plain_rows = [i for i in range(48) if i not in set(batch.edits.row.tolist())]
    np.testing.assert_array_equal(expected[plain_rows], logits[plain_rows])


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_mixed_batch_step_matches_twin(gpu, seed):
    """Plain and processed rows in one batch: edits -> sampler (min_p too) -> logprobs, the
    GPU launch by launch against sample_step."""
    rng = np.random.default_rng(seed)
    seqs = random_sequences(rng, 64, VOCAB)
    batch = SamplingBatch.from_sequences(seqs, EOS)
    logits = (rng.standard_normal((64, VOCAB)) * rng.choice([1.0, 4.0, 10.0])).astype(np.float32)
    expected_ids, expected_lp = sample_step(logits.copy(), batch)
    edited = gpu_edit(gpu, logits, batch) if batch.edits is not None else logits
    ids = gpu_sample(gpu, edited, batch)
    np.testing.assert_array_equal(ids, expected_ids)
    rows = batch.logprob_rows
    assert len(rows) and expected_lp is not None
    lp, rank, top, top_lp = gpu_logprobs(gpu, logits, ids, batch.logprob_k, rows=rows)
    np.testing.assert_array_equal(rank, expected_lp.sampled_rank)
    np.testing.assert_array_equal(top, expected_lp.top_ids)
    lse = lse64(logits[rows])
    assert np.all(np.abs(lp - expected_lp.sampled_logprob) <= ulp(lse) + ulp(expected_lp.sampled_logprob))
    assert np.all(np.abs(top_lp - expected_lp.top_logprobs)
                  <= ulp(lse)[:, None] + ulp(expected_lp.top_logprobs))


@pytest.mark.parametrize("vocab", [VOCAB, 1000, 21])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_step_logprobs_matches_twin(gpu, vocab, k):
    rng = np.random.default_rng(vocab + k)
    n = 40
    x = (rng.standard_normal((n, vocab)) * 5).astype(np.float32)
    x[1, [3, vocab // 2, vocab - 1]] = 40.0                  # ties at the top: lower id first
    x[2, :] = 1.5                                            # all tied
    x[3, :vocab - 4] = -np.inf                               # fewer finite tokens than k
    x[4] = np.round(x[4])                                    # many ties everywhere
    sampled = rng.integers(0, vocab, n).astype(np.int32)
    sampled[5] = -1                                          # a broken row's id
    lp, rank, top, top_lp = gpu_logprobs(gpu, x, sampled, k)
    e_lp, e_rank, e_top, e_top_lp = step_logprobs(x, sampled, k)
    np.testing.assert_array_equal(rank, e_rank)
    np.testing.assert_array_equal(top, e_top)
    ok = np.arange(n) != 5
    lse = lse64(x)
    with np.errstate(invalid="ignore"):         # a sampled -inf logit: -inf on both sides
        assert np.all((lp[ok] == e_lp[ok]) | (np.abs(lp[ok] - e_lp[ok]) <= ulp(lse[ok]) + ulp(e_lp[ok])))
    assert np.isnan(lp[5]) and rank[5] == 0
    finite = np.isfinite(e_top_lp)
    np.testing.assert_array_equal(np.isfinite(top_lp), finite)
    bound = ulp(lse)[:, None] + ulp(e_top_lp)
    with np.errstate(invalid="ignore"):
        assert np.all(np.abs(top_lp - e_top_lp)[finite] <= bound[finite])


def test_null_min_p_is_min_p_zero(gpu):
    """The plain path passes min_p as an arena array of zeros, a bare launch as null: the same
    ids and the same weights written over the logits."""
    drv, ops = gpu
    rng = np.random.default_rng(10)
    n = 32
    x = (rng.standard_normal((n, VOCAB)) * 4).astype(np.float32)
    batch = SamplingBatch.build(rng.choice([0.0, 0.8], n), rng.choice([-1, 40], n), rng.choice([1.0, 0.9], n),
                                rng.integers(0, 2**63, n), rng.integers(0, 1000, n))
    args = [drv.to_device(np.ascontiguousarray(a)) for a in (batch.temperature, batch.top_k, batch.top_p,
                                                              batch.seed, batch.step)]
    zeros = drv.to_device(np.zeros(n, np.float32))
    results = []
    for min_p in (0, int(zeros)):
        logits = drv.to_device(x)
        out = drv.to_device(np.full(n, -7, np.int32))
        ops.sample(int(logits), n, VOCAB, *map(int, args), int(out), min_p=min_p)
        drv.Context.synchronize()
        results.append((drv.from_device(out, (n,), np.int32), drv.from_device(logits, x.shape, np.float32)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    np.testing.assert_array_equal(results[0][0], sample(x.copy(), batch))


def test_min_p_sampling_matches_twin(gpu):
    rng = np.random.default_rng(9)
    n = 96
    x = (rng.standard_normal((n, VOCAB)) * rng.choice([2.0, 6.0, 12.0], (n, 1))).astype(np.float32)
    batch = SamplingBatch.build(rng.choice([0.0, 0.6, 1.0, 1.5], n), rng.choice([-1, 20, 500], n),
                                rng.choice([1.0, 0.95, 0.6], n), rng.integers(0, 2**63, n),
                                rng.integers(0, 1000, n), min_p=rng.choice([0.0, 0.01, 0.1, 0.5, 1.0], n))
    np.testing.assert_array_equal(gpu_sample(gpu, x, batch), sample(x.copy(), batch))


# -- the runner's optional road ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import EngineConfig, ModelConfig
    from tinyvllm.gpu.cuda_runner import CudaRunner
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    runner = CudaRunner(cfg, load_weights(tiny_model_dir, cfg),
                        EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, num_kv_blocks=128,
                                     block_size=16, max_model_len=2048))
    yield cfg, runner
    runner.close()


def test_runner_processed_steps_replay_equals_eager_and_twin(tiny):
    """Decode steps with edits and logprobs: the forward-only graph + eager sampler road gives
    exactly the eager road's ids and logprobs, and the twin's on the same raw logits; a plain
    step afterwards still takes the full graph and reports no logprobs."""
    from tinyvllm.engine.batch import ForwardBatch
    cfg, runner = tiny
    rng = np.random.default_rng(12)
    seqs = random_sequences(rng, 3, cfg.vocab_size, plain_fraction=0.0)
    for s, lp in zip(seqs, (3, None, 0)):
        s.params = dataclasses.replace(s.params, logprobs=lp)      # SamplingParams is frozen
    lens = [9, 25, 14]
    tables = [[10, 11], [20, 21, 22], [30, 31]]
    prompt = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    runner.execute(ForwardBatch.build(prompt, lens, tables, 16, is_prefill=True), SamplingBatch.greedy(3))
    tokens = [1, 2, 3]
    for step in range(6):
        lens = [c + 1 for c in lens]
        batch = ForwardBatch.build([[t] for t in tokens], lens, tables, 16, is_prefill=False)
        sampling = SamplingBatch.from_sequences(seqs, EOS)
        with runner.device.active():     # the raw logits of the very launches execute() runs:
            step_shape = runner._stage_inputs(batch, None, rows=runner._graph_size_for(3))   # padded
            runner.model.forward(step_shape)
            raw = runner._copy_logits(3)
        eager = runner.execute(batch, sampling, replay=False)
        eager_lp = runner.last_logprobs
        graph = runner.execute(batch, sampling)
        graph_lp = runner.last_logprobs
        np.testing.assert_array_equal(graph, eager)
        for name in ("rows", "sampled_logprob", "sampled_rank", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(graph_lp, name), getattr(eager_lp, name))
        want_ids, want_lp = sample_step(raw.copy(), sampling)
        np.testing.assert_array_equal(graph, want_ids)
        np.testing.assert_array_equal(graph_lp.rows, [0, 2])
        np.testing.assert_array_equal(graph_lp.top_ids, want_lp.top_ids)
        lse = lse64(raw[[0, 2]])
        assert np.all(np.abs(graph_lp.sampled_logprob - want_lp.sampled_logprob)
                      <= ulp(lse) + ulp(want_lp.sampled_logprob))
        for s, t in zip(seqs, graph):
            s.token_ids.append(int(t))
        tokens = [int(t) for t in graph]
    assert runner.forward_graphs, "processed decode steps replay a forward-only graph"
    plain = runner.execute(batch, SamplingBatch.greedy(3))
    assert runner.last_logprobs is None and plain.shape == (3,)
