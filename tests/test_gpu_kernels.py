"""Every CUDA kernel and linear() against its numpy twin in tinyvllm/reference/kernels.py, through
the same launchers (gpu/ops/) the model calls, on fresh random inputs with the outputs poisoned
first. Tolerances: bf16 outputs, relative (Frobenius) error
<= 1e-2 unless stated; copies must be exact."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.reference import kernels as ref
from tinyvllm.rope import rope_inv_freq

pytestmark = pytest.mark.gpu
BF16_TOL = 1e-2


def _sync():
    import pycuda.driver as drv
    drv.Context.synchronize()


@pytest.mark.parametrize("vocab,hidden,tokens", [(1000, 256, 37), (128256, 2048, 5), (49152, 576, 3)])
@pytest.mark.parametrize("fed", [False, True])
@pytest.mark.parametrize("norm", [False, True], ids=["gather", "handed_over_norm"])
def test_embedding_gather(gpu, rng, vocab, hidden, tokens, fed, norm):
    """Exact (a copy). Ids out of range (-1, vocab) give zero rows; with fed rows, about half
    the tokens take their id from a previous step's sampled ids, which hold one -1 (the
    sampler's non-finite row) and otherwise ids in range. norm (the first input norm handed over,
    embedding.cu's header): normed must equal bf16(out * norm_w) bitwise (one exact fp32 product,
    one rounding: ref.rms_norm_operand), and each row sum of 16 squares (exact products, a 16-term
    fp32 sum: at most 4 roundings deep in chunk_sum_sq's tree) lie within 4 u of its float64 value;
    a guard row past the tokens keeps its poison. The LM head's argmax keys of the step's tokens
    are cleared to 0 (a guard entry past them keeps its value)."""
    from gpu_helpers import BF16, DeviceArray, to_bf16
    norm_args = None
    if norm:
        norm_w = to_bf16(1 + 0.2 * rng.standard_normal(hidden))
        normed = DeviceArray.poisoned((tokens + 1, hidden), BF16)
        row_ss = DeviceArray.poisoned((tokens + 1, hidden // 16), np.float32)
        norm_args = (DeviceArray(norm_w), normed, row_ss)
        keys = DeviceArray(np.full(tokens + 1, 0x0123456789ABCDEF, np.uint64))   # the LM head's argmax keys
    table = to_bf16(rng.standard_normal((vocab, hidden)))
    ids = rng.integers(0, vocab, tokens).astype(np.int32)
    ids[rng.integers(0, tokens)] = rng.choice([-1, vocab])
    fed_rows = fed_ids = None
    if fed:
        fed_ids = rng.integers(0, vocab, 8).astype(np.int32)
        fed_ids[rng.integers(0, 8)] = -1
        fed_rows = np.where(rng.random(tokens) < 0.5, rng.integers(0, 8, tokens), -1).astype(np.int32)
        fed_rows[0] = int(np.flatnonzero(fed_ids == -1)[0])
    keep = [DeviceArray(a) for a in (table, ids, fed_rows, fed_ids) if a is not None]   # alive until the sync
    out = DeviceArray.poisoned((tokens, hidden), table.dtype)
    gpu.embedding(out, keep[0], keep[1], tokens, hidden, vocab,
                  fed_rows=keep[2] if fed else 0, fed_ids=keep[3] if fed else 0, norm=norm_args,
                  head_argmax=keys if norm else 0)
    _sync()
    expected = ref.embedding(ids, table, fed_rows, fed_ids)
    np.testing.assert_array_equal(out.get().astype(np.float32), expected)
    assert not expected[0].any() or not fed         # the fed -1 gave a zero row
    if norm:
        got_normed, got_ss = normed.get(), row_ss.get()
        np.testing.assert_array_equal(got_normed[:tokens].astype(np.float32), ref.rms_norm_operand(expected, norm_w))
        exact = (expected.astype(np.float64) ** 2).reshape(tokens, hidden // 16, 16).sum(-1)
        assert np.all(np.abs(got_ss[:tokens] - exact) <= 4 * 2.0 ** -24 * exact), "row sums of squares"
        assert np.all(np.isnan(got_normed[tokens].astype(np.float32))) and np.all(np.isnan(got_ss[tokens]))
        got_keys = keys.get()     # cleared for the step's tokens, for the head's atomicMax
        assert not got_keys[:tokens].any() and got_keys[tokens] == 0x0123456789ABCDEF


def test_embedding_rejects_a_norm_it_cannot_hand_over(gpu):
    with pytest.raises(ValueError, match="hidden % 16"):
        gpu.embedding(0, 0, 0, 1, 264, 10, norm=(16, 16, 16))


@pytest.mark.parametrize("hidden", [256, 2056, 4096])
@pytest.mark.parametrize("with_rows", [False, True])
def test_rms_norm(gpu, rng, hidden, with_rows):
    from gpu_helpers import DeviceArray, rel_err, to_bf16
    T = 33
    x = to_bf16(rng.standard_normal((T, hidden)) * 3)
    w = to_bf16(1 + 0.1 * rng.standard_normal(hidden))
    rows = rng.permutation(T)[:7].astype(np.int32) if with_rows else None
    n = len(rows) if with_rows else T
    out = DeviceArray.poisoned((n, hidden), x.dtype)
    d_rows = DeviceArray(rows) if with_rows else None
    d_x, d_w = DeviceArray(x), DeviceArray(w)
    gpu.rms_norm(out, d_x, d_w, n, hidden, 1e-5, rows=int(d_rows) if with_rows else 0)
    _sync()
    want = ref.rms_norm(x[rows] if with_rows else x, w, 1e-5)
    assert rel_err(out.get(), want) < BF16_TOL


def test_silu_mul(gpu, rng):
    from gpu_helpers import DeviceArray, rel_err, to_bf16
    T, inter = 19, 1000
    gate_up = to_bf16(rng.standard_normal((T, 2 * inter)) * 2)
    out = DeviceArray.poisoned((T, inter), gate_up.dtype)
    d_gate_up = DeviceArray(gate_up)
    gpu.silu_mul(out, d_gate_up, T, inter)
    _sync()
    want = ref.silu_mul(gate_up[:, :inter], gate_up[:, inter:])
    assert rel_err(out.get(), want) < BF16_TOL


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (24, 8, 128), (4, 2, 64)])
def test_rope_write_kv(gpu, rng, hq, hkv, d):
    import dataclasses

    from gpu_helpers import DeviceArray, rel_err, to_bf16

    from tinyvllm.checkpoint.model_writer import preset_config
    inv_freq = rope_inv_freq(dataclasses.replace(preset_config("llama-3.2-1b"), head_dim=d))
    T, block_size, num_blocks = 45, 16, 9
    qkv = to_bf16(rng.standard_normal((T, (hq + 2 * hkv) * d)))
    positions = rng.integers(0, 131072, T).astype(np.int32)
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int32)
    slots[[3, 17]] = -1                                           # padding tokens: no write
    d_qkv = DeviceArray(qkv)
    k_cache = DeviceArray.poisoned((num_blocks, block_size, hkv, d), qkv.dtype)
    v_cache = DeviceArray.poisoned((num_blocks, block_size, hkv, d), qkv.dtype)
    inputs = [DeviceArray(a) for a in (positions, slots, inv_freq)]
    gpu.rope_write_kv(d_qkv, k_cache, v_cache, *inputs, T, hq, hkv, d)
    _sync()
    q = qkv[:, :hq * d].reshape(T, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].reshape(T, hkv, d)
    v = qkv[:, (hq + hkv) * d:].reshape(T, hkv, d)
    got_q = d_qkv.get()[:, :hq * d].reshape(T, hq, d)
    assert rel_err(got_q, ref.apply_rope(q, positions, inv_freq)) < BF16_TOL
    want_k = np.full((num_blocks, block_size, hkv, d), np.nan, np.float32)
    want_v = want_k.copy()
    ref.write_kv(want_k, want_v, ref.apply_rope(k, positions, inv_freq), v, slots)
    got_k, got_v = k_cache.get().astype(np.float32), v_cache.get().astype(np.float32)
    written = ~np.isnan(want_k[..., 0, 0])
    assert np.isnan(got_k[~written]).all() and np.isnan(got_v[~written]).all(), "wrote outside slot_mapping"
    assert rel_err(got_k[written], want_k[written]) < BF16_TOL
    np.testing.assert_array_equal(got_v[written], want_v[written])


def _attention_case(rng, q_lens, context_lens, hq, hkv, d, block_size=16):
    from gpu_helpers import shuffled_block_tables, to_bf16
    tables, num_blocks = shuffled_block_tables(rng, context_lens, block_size)
    batch = ForwardBatch.build([[0] * n for n in q_lens], list(context_lens), tables, block_size,
                               is_prefill=True)
    k_cache = to_bf16(rng.standard_normal((num_blocks, block_size, hkv, d)))
    v_cache = to_bf16(rng.standard_normal((num_blocks, block_size, hkv, d)))
    q = to_bf16(rng.standard_normal((batch.num_tokens, hq, d)))
    want = ref.paged_attention(q, k_cache, v_cache, batch, 1 / math.sqrt(d))
    return batch, q, k_cache, v_cache, want


def _run_prefill(gpu, rng, q_lens, cached, hq, hkv, d, block_size):
    """Launch attention_prefill through its launcher on a poisoned output; check every sequence.
    Tolerance BF16_TOL (1e-2 relative): the kernel rounds P = softmax numerators (in [0, 1]) to
    bf16 for the P·V mma (relative error <= 2^-9 = 2e-3 per element, rounded to nearest, so the
    errors of a row's terms are independent and mostly cancel in the fp32 sum) and the output to
    bf16 (<= 2^-9); S, the row max/sum and O accumulate in fp32 and the row sum uses the unrounded
    P. A lane-exact numpy emulation of the kernel's fragments gave 2.0-2.1e-3 on these shapes."""
    from gpu_helpers import DeviceArray, rel_err
    batch, q, kc, vc, want = _attention_case(rng, q_lens, [a + b for a, b in zip(q_lens, cached)],
                                             hq, hkv, d, block_size)
    out = DeviceArray.poisoned((batch.num_tokens, hq, d), q.dtype)
    width = np.array([batch.block_tables.shape[1]], np.int32)
    d_q, d_k, d_v, d_tables, d_width, d_qs, d_ctx = (DeviceArray(a) for a in (
        q, kc, vc, batch.block_tables, width, batch.query_start, batch.context_lens))
    gpu.attention_prefill(out, d_q, hq * d, d_k, d_v, d_tables, d_width, d_qs, d_ctx,
                          num_seqs=batch.num_seqs, max_query_len=max(q_lens), num_q_heads=hq,
                          num_kv_heads=hkv, head_dim=d, block_size=block_size, scale=1 / math.sqrt(d))
    _sync()
    got = out.get()
    for i in range(batch.num_seqs):
        s, e = batch.query_start[i], batch.query_start[i + 1]
        assert rel_err(got[s:e], want[s:e]) < BF16_TOL, f"sequence {i} (q_len {q_lens[i]}, cached {cached[i]})"


# (query heads, kv heads, head_dim, block_size): GQA groups 1, 2, 3, 4, 8; the 1B and 8B head shapes
PREFILL_SHAPES = [(8, 8, 64, 16), (8, 4, 128, 8), (6, 2, 64, 32), (32, 8, 64, 16), (32, 8, 128, 8),
                  (16, 2, 128, 32), (16, 2, 64, 8)]


@pytest.mark.parametrize("hq,hkv,d,block_size", PREFILL_SHAPES)
def test_attention_prefill(gpu, rng, hq, hkv, d, block_size):
    """Ragged prompts around the 16-row warp tile and the 64-row/64-key CTA tiles, about half with
    a cached prefix (context > query length, the first position off any tile boundary), over
    shuffled block tables."""
    q_lens = [1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 2, 40]
    cached = [0, 0, 16, 5, 0, 64, 1, 0, 100, 37, 300, 129]
    _run_prefill(gpu, rng, q_lens, cached, hq, hkv, d, block_size)


@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 2, 64, 16), (8, 2, 128, 32)])
def test_attention_prefill_long(gpu, rng, hq, hkv, d, block_size):
    """A 4,100-token prompt (65 query tiles, the last one 4 rows) beside a 300-token chunk behind a
    3,001-token cached prefix and a short prompt: the long-context and heaviest-tile-first paths."""
    _run_prefill(gpu, rng, [4100, 300, 7], [0, 3001, 0], hq, hkv, d, block_size)


# The contexts the decode kernel's split and step arithmetic can get wrong: 1 token, either side
# of one 16-token warp step and of the 128-token minimum split (a step for each of the 8 warps),
# 2, 3 and 4 steps a warp in one split (the third is the last the prologue copies before the PDL
# wait, the fourth the first of the main loop, which reuses the first's stage),
# either side of the one-split limit (512: shorter contexts run one split whatever the grid), a
# split count that does not divide the context, and 5,000 (many steps per warp).
DECODE_CONTEXTS = [1, 15, 16, 17, 63, 64, 65, 128, 129, 256, 257, 383, 384, 512, 513, 1024, 4129, 5000]
# batch -> block size: the 7-sequence batch pages every token separately (a step spans 16 pages)
DECODE_BATCHES = {1: 16, 7: 1, 256: 32}


def _decode_batches(rng, batch: int) -> list[list[int]]:
    """The context lengths of each batch one test case launches."""
    if batch == 1:
        return [[c] for c in DECODE_CONTEXTS]
    if batch == 7:
        return [[int(c) for c in rng.choice(DECODE_CONTEXTS, 7, replace=False)]]
    # a large batch: short random contexts (the launcher then picks one split) with the special
    # ones mixed in, in random order
    ctx = np.concatenate([rng.integers(1, 160, batch - 6), [1, 16, 17, 129, 257, 1024]])
    return [[int(c) for c in rng.permutation(ctx)]]


def _decode_launcher(gpu, fb, q, kc, vc, hq, hkv, d, block_size):
    """Device copies of one attention_decode case (_attention_case's arrays) and a poisoned
    workspace -> (launch, counters): launch(**options) runs the launcher on them into a freshly
    poisoned output and returns it on the host."""
    from gpu_helpers import DeviceArray

    from tinyvllm.gpu.ops import MAX_DECODE_SPLITS
    S = fb.num_seqs
    part_out = DeviceArray.poisoned((S, hq, MAX_DECODE_SPLITS, d), np.float32)
    part_ml = DeviceArray.poisoned((S, hq, MAX_DECODE_SPLITS, 2), np.float32)
    counters = DeviceArray(np.zeros((S, hkv), np.int32))
    width = np.array([fb.block_tables.shape[1]], np.int32)
    d_q, d_k, d_v, d_tables, d_width, d_ctx = (DeviceArray(a) for a in (
        q, kc, vc, fb.block_tables, width, fb.context_lens))

    def launch(**options):
        out = DeviceArray.poisoned((S, hq, d), q.dtype)
        gpu.attention_decode(out, part_out, part_ml, counters, d_q, hq * d, d_k, d_v, d_tables, d_width,
                             d_ctx, num_seqs=S, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             block_size=block_size, scale=1 / math.sqrt(d), **options)
        _sync()
        return out.get()
    return launch, counters


@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 64), (16, 8, 64), (24, 8, 64), (32, 8, 64), (16, 2, 64),
                                      (8, 8, 128), (8, 4, 128), (24, 8, 128), (32, 8, 128), (64, 8, 128)])
@pytest.mark.parametrize("batch", sorted(DECODE_BATCHES))
@pytest.mark.parametrize("splits", [None, 1, 5, 32])
def test_attention_decode(gpu, rng, hq, hkv, d, batch, splits):
    """One query per sequence through the launcher the model calls, GQA groups 1/2/3/4/8 at
    head_dim 64 and 128, against the numpy twin on fresh random inputs, outputs and workspace
    poisoned. Batch 1 runs every context of DECODE_CONTEXTS. splits=None is the launcher's own
    choice for the batch size (32 at batch 1, 1 at 256); 1/5/32 force the grid. A short context
    uses fewer splits than the grid has; with several, the last block of each (sequence, kv head)
    merges them and resets its counter: a second launch on the same buffers must give
    bit-identical results, counters back at zero. Tolerance BF16_TOL: q, K, V are bf16, the
    probabilities are rounded to bf16 for the P.V MMA (as in FlashAttention), sums are fp32."""
    from gpu_helpers import rel_err
    block_size = DECODE_BATCHES[batch]
    for ctx in _decode_batches(rng, batch):
        fb, q, kc, vc, want = _attention_case(rng, [1] * len(ctx), ctx, hq, hkv, d, block_size=block_size)
        run, counters = _decode_launcher(gpu, fb, q, kc, vc, hq, hkv, d, block_size)
        first = None
        for launch in range(2):
            got = run(splits=splits)
            for i in range(fb.num_seqs):
                assert rel_err(got[i], want[i]) < BF16_TOL, f"launch {launch}, sequence {i} (context {ctx[i]})"
            np.testing.assert_array_equal(counters.get(), 0)
            if first is None:
                first = got
            else:
                np.testing.assert_array_equal(got.view(np.uint16), first.view(np.uint16))


# Contexts for the newest row (position ctx - 1), which the decode attention loads itself after
# the PDL wait while its early K/V copies of the other rows go out before it (attention_decode.cu's
# header): in a warp's first, second or third prologue step (one split up to 512 tokens, 8 warps x
# 16 tokens a step: ctx <= 128, 129..256, 257..384), in a main-loop step (1024 and 4129 at
# splits=1), in the last of several splits (1024 and 4129 otherwise), in a 16-token step's first
# or last row, and ctx = 1, where the only row is the newest. test_attention_decode's 384 and 512
# take the last prologue row and a main-loop row inside one split.
NEWEST_ROW_CONTEXTS = [1, 2, 15, 16, 17, 31, 64, 127, 128, 129, 255, 256, 257, 300, 1024, 4129]


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (16, 2, 64), (8, 8, 128), (24, 8, 128)])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_attention_decode_newest_row(gpu, rng, hq, hkv, d, splits):
    """The newest K/V row, wherever NEWEST_ROW_CONTEXTS put it, at batch 1 and on one batch of all
    of them (block size 1 there: every row its own page): the outputs match the numpy twin (as
    test_attention_decode), counters back at zero, and a second launch gives the same bits."""
    from gpu_helpers import rel_err
    cases = [([c], 16) for c in NEWEST_ROW_CONTEXTS] + [(list(rng.permutation(NEWEST_ROW_CONTEXTS)), 1)]
    for ctx, block_size in cases:
        ctx = [int(c) for c in ctx]
        fb, q, kc, vc, want = _attention_case(rng, [1] * len(ctx), ctx, hq, hkv, d, block_size=block_size)
        run, counters = _decode_launcher(gpu, fb, q, kc, vc, hq, hkv, d, block_size)
        first = None
        for launch in range(2):
            got = run(splits=splits)
            np.testing.assert_array_equal(counters.get(), 0)
            for i in range(fb.num_seqs):
                assert rel_err(got[i], want[i]) < BF16_TOL, f"launch {launch}, sequence {i} (context {ctx[i]})"
            if first is None:
                first = got.view(np.uint16)
            else:
                np.testing.assert_array_equal(got.view(np.uint16), first, err_msg=f"contexts {ctx}")


def test_attention_decode_rejects_bad_splits(gpu):
    from tinyvllm.gpu.ops import MAX_DECODE_SPLITS
    with pytest.raises(ValueError, match="splits"):
        gpu.attention_decode(0, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, num_seqs=1, num_q_heads=1, num_kv_heads=1,
                             head_dim=64, block_size=16, scale=1.0, splits=MAX_DECODE_SPLITS + 1)


@pytest.mark.parametrize("m,n,k", [(1, 3072, 2048), (7, 1000, 264), (33, 130, 72), (300, 2048, 8192)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_linear(gpu, rng, m, n, k, accumulate):
    """Y (+)= X @ W^T through linear() as the model calls it (the GEMV at m <= 8, cuBLAS's
    transpose trick above), bf16 in, bf16 out, odd shapes."""
    from gpu_helpers import DeviceArray, rel_err, to_bf16
    x, w = to_bf16(rng.standard_normal((m, k))), to_bf16(rng.standard_normal((n, k)) / math.sqrt(k))
    y0 = to_bf16(rng.standard_normal((m, n)))
    y = DeviceArray(y0) if accumulate else DeviceArray.poisoned((m, n), x.dtype)
    d_x, d_w = DeviceArray(x), DeviceArray(w)
    gpu.linear(y, d_x, d_w, m, n, k, accumulate=accumulate)
    _sync()
    want = x.astype(np.float32) @ w.astype(np.float32).T + (y0.astype(np.float32) if accumulate else 0)
    assert rel_err(y.get(), want) < BF16_TOL


def test_linear_fp32_out(gpu, rng):
    """The LM head's variant: fp32 logits; tolerance 1e-3 (only the bf16 inputs are rounded)."""
    from gpu_helpers import DeviceArray, rel_err, to_bf16
    m, n, k = 5, 12345, 256
    x, w = to_bf16(rng.standard_normal((m, k))), to_bf16(rng.standard_normal((n, k)))
    y = DeviceArray.poisoned((m, n), np.float32)
    d_x, d_w = DeviceArray(x), DeviceArray(w)
    gpu.blas.matmul(int(y), int(d_x), int(d_w), m, n, k, out_dtype="float32")   # the LM head's path (n > GEMV_MAX_N)
    _sync()
    assert rel_err(y.get(), x.astype(np.float32) @ w.astype(np.float32).T) < 1e-3


