"""Cascade (shared-prefix) decode attention on the GPU (attention_cascade.cu's header): the suffix,
attention_decode from the prefix's end with its log-sum-exp, against its numpy partial; the whole
cascade (that suffix, then attention_cascade_prefix's pass over the prefix and merge) against
reference/cascade.py and against plain paged attention; and greedy decoding with the prefix shared
(cascade) against the same prefix copied into private blocks.

Tolerances. Outputs: BF16_TOL (1e-2 relative, per sequence), test_gpu_kernels' decode bound,
whose error model holds for each part (q, K, V bf16; probabilities rounded to bf16 for the P V
MMA, relative 2^-9 each, independent and mostly cancelling in the fp32 sums; sums and the merge
in fp32). A cascade adds one rounding: the suffix's output is stored in bf16 before the merge
reads it (2^-9 relative on a share of the output at most 1), so three 2^-9 terms at worst, 5.9e-3,
under the bound (the decode kernel alone measured 1.9e-3: docs/perf-notes.md 3.11). The
log-sum-exp has its own bound, lse_bound. Greedy tokens: equal up to test_gpu_engine's near-tie
rule (assert_same_greedy)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_gpu_engine import assert_same_greedy
from test_gpu_kernels import BF16_TOL, _sync

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.gpu.ops import CASCADE, DECODE_SHAPES, MAX_CASCADE_SPLITS, MAX_DECODE_SPLITS, cascade_tiles
from tinyvllm.reference.cascade import attention_partial, cascade_paged_attention
from tinyvllm.reference.kernels import gather_kv, paged_attention

pytestmark = pytest.mark.gpu
U = 2.0 ** -24                   # float32's unit roundoff
LOG2E = 1 / math.log(2)


def shared_prefix_case(rng, hq, hkv, d, bs, prefix_blocks, own_lens):
    """A decode batch whose sequences share their first prefix_blocks physical blocks, then hold
    own_lens[i] positions each (0: none) in shuffled blocks of their own; bf16 q, K, V, and NaN in
    every cache slot no sequence holds (a read of one shows). -> (batch, q, k_cache, v_cache)."""
    from gpu_helpers import to_bf16
    own_blocks = [-(-n // bs) for n in own_lens]
    num_blocks = prefix_blocks + sum(own_blocks) + 3
    ids = [int(b) for b in rng.permutation(num_blocks)]
    prefix, at, tables, held = ids[:prefix_blocks], prefix_blocks, [], np.zeros((num_blocks, bs), bool)
    held[prefix] = True
    for n, b in zip(own_lens, own_blocks):
        own, at = ids[at:at + b], at + b
        tables.append(prefix + own)
        pos = np.arange(n)
        held[np.asarray(own, np.int64)[pos // bs], pos % bs] = True
    k_cache, v_cache = (to_bf16(np.where(held[..., None, None], rng.standard_normal((num_blocks, bs, hkv, d)), np.nan))
                        for _ in range(2))
    width = max(len(t) for t in tables)
    padded = np.array([t + [-1] * (width - len(t)) for t in tables], np.int32)
    batch = ForwardBatch.build_decode([0] * len(own_lens), [prefix_blocks * bs + n for n in own_lens], padded, bs)
    return batch, to_bf16(rng.standard_normal((len(own_lens), hq, d))), k_cache, v_cache


def launch_cascade(gpu, batch, q, k_cache, v_cache, prefix_len: int, *, prefix=True, splits=None,
                   prefix_splits=None):
    """attention_decode from prefix_len (its lse kept; splits: its grid's) and, with prefix,
    attention_cascade_prefix after it on the same stream (prefix_splits: its grid's; None: the
    launcher's), every output and workspace poisoned first -> (out, lse, decode's split counters,
    the prefix kernel's) on the host."""
    from gpu_helpers import BF16, DeviceArray
    S, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out, lse = DeviceArray.poisoned((S, hq, d), BF16), DeviceArray.poisoned((S, hq), np.float32)
    part_out = DeviceArray.poisoned((S, hq, MAX_DECODE_SPLITS, d), np.float32)
    part_ml = DeviceArray.poisoned((S, hq, MAX_DECODE_SPLITS, 2), np.float32)
    counters = DeviceArray(np.zeros((S, hkv), np.int32))
    tiles = cascade_tiles(S, hq, hkv)
    prefix_o = DeviceArray.poisoned((tiles, MAX_CASCADE_SPLITS, CASCADE["BLOCK_Q"], d), np.float32)
    prefix_ml = DeviceArray.poisoned((tiles, MAX_CASCADE_SPLITS, CASCADE["BLOCK_Q"], 2), np.float32)
    prefix_counters = DeviceArray(np.zeros(tiles, np.int32))
    d_q, d_k, d_v, d_tables, d_width, d_ctx, d_prefix = (DeviceArray(a) for a in (
        q, k_cache, v_cache, batch.block_tables, np.array([batch.block_tables.shape[1]], np.int32),
        batch.context_lens, np.array([prefix_len], np.int32)))
    shape = dict(num_seqs=S, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, scale=d ** -0.5)
    gpu.attention_decode(out, part_out, part_ml, counters, d_q, hq * d, d_k, d_v, d_tables, d_width, d_ctx,
                         **shape, splits=splits, first_position=d_prefix, lse_out=lse)
    if prefix:
        gpu.attention_cascade_prefix(out, lse, prefix_o, prefix_ml, prefix_counters, d_q, hq * d, d_k, d_v,
                                     d_tables, d_prefix, **shape, splits=prefix_splits)
    _sync()
    return out.get().astype(np.float32), lse.get(), counters.get(), prefix_counters.get()


def prefix_splits_used(prefix_len: int, head_dim: int, grid_splits: int) -> int:
    """The splits attention_cascade_prefix cuts a prefix into on a grid of grid_splits
    (attention_cascade.cu's header: splits): tiles of TILE_K keys (WIDE_TILE_K from WIDE_HEAD_DIM
    on), at least MIN_SPLIT_KEYS a split, none empty."""
    tile = CASCADE["WIDE_TILE_K"] if head_dim >= CASCADE["WIDE_HEAD_DIM"] else CASCADE["TILE_K"]
    tiles = -(-prefix_len // tile)
    per_split = max(CASCADE["MIN_SPLIT_KEYS"] // tile, -(-tiles // grid_splits))
    return -(-tiles // per_split)


def lse_bound(q, k, scale: float) -> float:
    """How far attention_decode's lse may lie from the exact base-2 log-sum-exp of q [G, D]
    against k [n, D] (one sequence's kv head), both bf16 (exact in float64). lse is 1-Lipschitz
    in each score, so an error delta in every score moves it by at most delta; the terms:
      * the scores in base 2: a D-term dot product on the tensor cores (exact products; their
        fp32 additions truncate (Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021),
        so two unit roundoffs a step), then the products by scale * log2(e) (three roundings):
        gamma_(D+3) with 2u, times sum_d |q_d k_d| * scale * log2(e);
      * each term of l is a product of ex2.approx values: its own weight 2^(s - m) and the
        rescales 2^(m_old - m_new) of the online softmax (at most one a 16-token step), of the
        warps' merge and of the splits' merge: at most n / 16 + 3 of them, each with its argument
        rounded once (|argument| <= 2 S, S >= every |s|: a factor 2^(+-2 S u)) and ex2.approx's
        own error, taken as 2^-20 relative (common.cuh: __expf, ex2.approx after one product, is
        within 2 ulp + 2^-21);
      * l, a sum of n positive terms with those rescales between: gamma_(n + 64) relative,
        whatever the order (Higham 4.2);
      * a relative error r of l moves lse by at most -log2(1 - r);
      * log2f and the final m + log2 l: a few roundings of at most S + log2 n + 1."""
    g2 = lambda k_: k_ * 2 * U / (1 - k_ * 2 * U)  # noqa: E731
    gamma = lambda k_: k_ * U / (1 - k_ * U)  # noqa: E731
    d, n = q.shape[1], k.shape[0]
    abs_dot = float((np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)).T).max()) * scale * LOG2E
    delta = g2(d + 3) * abs_dot
    s = abs_dot + delta
    factors = math.ceil(n / 16) + 3
    rel = (2 ** (2 * s * U) * (1 + 2.0 ** -20)) ** factors * (1 + gamma(n + 64)) - 1
    return delta - math.log2(1 - rel) + 4 * U * (s + math.log2(n) + 1)


SUFFIX_SHAPES = [(32, 8, 64), (16, 2, 64), (8, 8, 128), (24, 8, 128), (8, 4, 256), (8, 1, 256)]


@pytest.mark.parametrize("hq,hkv,d", SUFFIX_SHAPES)
@pytest.mark.parametrize("splits", [None, 1, 5, MAX_DECODE_SPLITS])
def test_decode_suffix_and_lse(gpu, rng, hq, hkv, d, splits):
    """attention_decode with first_position = the prefix's length and lse_out: each sequence's
    output is its suffix's attention alone (reference/cascade.py's attention_partial, o / l) and
    its lse the base-2 log-sum-exp of those scores, on one split and on the merged path (suffixes
    of 600 and 4,129 positions), the prefix 0 too; a suffix of no position gives out 0 and lse -inf;
    the split counters are back at 0."""
    from gpu_helpers import rel_err
    bs = 16
    own = [0, 1, 15, 16, 17, 129, 300, 600, 4129]
    for prefix_blocks in (0, 16, 37):
        lens = own[1:] if prefix_blocks == 0 else own       # no sequence of no position at all
        batch, q, kc, vc = shared_prefix_case(rng, hq, hkv, d, bs, prefix_blocks, lens)
        first, scale = prefix_blocks * bs, d ** -0.5
        out, lse, counters, _ = launch_cascade(gpu, batch, q, kc, vc, first, prefix=False, splits=splits)
        np.testing.assert_array_equal(counters, 0)
        for i, n in enumerate(lens):
            ctx = int(batch.context_lens[i])
            if n == 0:
                assert np.all(out[i] == 0) and np.all(lse[i] == -np.inf), f"sequence {i}: no position"
                continue
            k = gather_kv(kc, batch.block_tables[i], ctx, first)
            v = gather_kv(vc, batch.block_tables[i], ctx, first)
            o, _, l_ = attention_partial(q[i:i + 1], k, v, scale)
            assert rel_err(out[i], o[0] / l_[0][:, None]) < BF16_TOL, f"prefix {first}, suffix {n}"
            k64, group = k.astype(np.float64), hq // hkv
            for h in range(hq):
                scores = q[i, h].astype(np.float64) @ k64[:, h // group].T * scale * LOG2E
                exact = scores.max() + math.log2(np.exp2(scores - scores.max()).sum())
                bound = lse_bound(q[i, h:h + 1], k[:, h // group], scale)
                assert abs(lse[i, h] - exact) <= bound, (i, h, lse[i, h] - exact, bound)


@pytest.mark.parametrize("batch_size", [8, 64, 256])
@pytest.mark.parametrize("d,group", sorted(DECODE_SHAPES))
def test_cascade_decode(gpu, rng, d, group, batch_size):
    """The whole cascade on every built (head_dim, group), 8 / 64 / 256 sequences sharing a prefix
    of 256..2,048 positions (blocks of 16 or 32), then 0..300 of their own (one with none, one
    with 1, one past the one-split limit: 700), against reference/cascade.py's
    cascade_paged_attention and against paged_attention. Llama-1B's (64, 4) with its 8 kv heads,
    the others with 2. A prefix length of 0 leaves attention_decode's output as it is, bit for bit."""
    from gpu_helpers import rel_err
    hkv = 8 if (d, group) == (64, 4) else 2
    hq, bs = hkv * group, 32 if batch_size == 64 else 16
    prefix_blocks = int(rng.integers(256 // bs, 2048 // bs + 1))
    own = [0, 1, 700, *rng.integers(0, 301, batch_size - 3)]
    batch, q, kc, vc = shared_prefix_case(rng, hq, hkv, d, bs, prefix_blocks, list(rng.permutation(own)))
    scale = d ** -0.5
    out, _, counters, prefix_counters = launch_cascade(gpu, batch, q, kc, vc, prefix_blocks * bs)
    np.testing.assert_array_equal(counters, 0)
    np.testing.assert_array_equal(prefix_counters, 0)
    twin = cascade_paged_attention(q, kc, vc, batch, scale, prefix_blocks)
    plain = paged_attention(q, kc, vc, batch, scale)
    for i in range(batch.num_seqs):
        what = f"sequence {i}: prefix {prefix_blocks * bs}, context {int(batch.context_lens[i])}"
        assert rel_err(out[i], twin[i]) < BF16_TOL, what
        assert rel_err(out[i], plain[i]) < BF16_TOL, what
    # no prefix this step: the prefix kernel leaves out and lse as attention_decode wrote them
    with_prefix_launch, lse, _, _ = launch_cascade(gpu, batch, q, kc, vc, 0)
    alone, lse_alone, _, _ = launch_cascade(gpu, batch, q, kc, vc, 0, prefix=False)
    np.testing.assert_array_equal(with_prefix_launch, alone)
    np.testing.assert_array_equal(lse, lse_alone)
    for i in range(batch.num_seqs):
        assert rel_err(alone[i], plain[i]) < BF16_TOL


SPLIT_SHAPES = [(64, 4, 8), (128, 8, 2), (256, 2, 2)]     # (head_dim, group, kv heads)
# shared prefixes in blocks of 16: none; 48 keys (one tile: one split whatever the grid); 208 (a
# few splits, fewer than a grid of MAX_CASCADE_SPLITS has); 1,040 (the last tile 16 keys at
# TILE_K 64); 2,992 (every split of a grid of MAX_CASCADE_SPLITS, the last tile partial)
SPLIT_PREFIX_BLOCKS = [0, 3, 13, 65, 187]


@pytest.mark.parametrize("prefix_splits", [1, 2, MAX_CASCADE_SPLITS, None])
@pytest.mark.parametrize("d,group,hkv", SPLIT_SHAPES)
def test_cascade_prefix_splits(gpu, rng, d, group, hkv, prefix_splits):
    """attention_cascade_prefix on a grid of 1 split (the direct merge), 2, MAX_CASCADE_SPLITS
    and the launcher's own (cascade_splits), over prefixes of 0 to 2,992 positions, among them
    ones shorter than the grid's splits (its surplus CTAs leave, one split merging directly or a
    few through the workspace): 37 sequences (q tiles of 64 rows, the last partial) with 0..300
    positions of their own, against reference/cascade.py and plain paged attention; the split
    counters back at 0; a second launch bit-identical to the first (the split that merges is
    whichever finishes last, yet the sums are in split order); prefix 0 leaves attention_decode's
    out and lse bit for bit."""
    from gpu_helpers import rel_err
    hq, bs, scale, seqs = hkv * group, 16, d ** -0.5, 37
    grid_splits = prefix_splits or gpu.cascade_splits(seqs, hq, hkv)
    used = {}
    for prefix_blocks in SPLIT_PREFIX_BLOCKS:
        own = [1, 300, *rng.integers(0 if prefix_blocks else 1, 301, seqs - 2)]
        batch, q, kc, vc = shared_prefix_case(rng, hq, hkv, d, bs, prefix_blocks, list(rng.permutation(own)))
        prefix_len = prefix_blocks * bs
        used[prefix_len] = prefix_splits_used(prefix_len, d, grid_splits) if prefix_len else 0
        out, lse, counters, prefix_counters = launch_cascade(gpu, batch, q, kc, vc, prefix_len,
                                                             prefix_splits=prefix_splits)
        np.testing.assert_array_equal(counters, 0)
        np.testing.assert_array_equal(prefix_counters, 0)
        if prefix_len == 0:
            alone, lse_alone, _, _ = launch_cascade(gpu, batch, q, kc, vc, 0, prefix=False)
            np.testing.assert_array_equal(out, alone)
            np.testing.assert_array_equal(lse, lse_alone)
        twin = cascade_paged_attention(q, kc, vc, batch, scale, prefix_blocks)
        plain = paged_attention(q, kc, vc, batch, scale)
        for i in range(seqs):
            what = f"sequence {i}: prefix {prefix_len} in {used[prefix_len]} of {grid_splits} splits"
            assert rel_err(out[i], twin[i]) < BF16_TOL, what
            assert rel_err(out[i], plain[i]) < BF16_TOL, what
        again, _, _, _ = launch_cascade(gpu, batch, q, kc, vc, prefix_len, prefix_splits=prefix_splits)
        np.testing.assert_array_equal(again, out)
    print(f"prefix splits used on a grid of {grid_splits}: {used}")
    if grid_splits == MAX_CASCADE_SPLITS:
        assert used[48] == 1 and 1 < used[208] < grid_splits and used[2992] == grid_splits, used


def _copy_blocks(runner, cfg, pairs) -> None:
    """Copy KV blocks (src -> dst, every layer's K and V) inside the runner's cache."""
    import pycuda.driver as drv
    kv, nbytes = runner.kv_cache, kv_block_bytes(cfg, runner.kv_cache.block_size)
    with runner.device.active():
        for layer in range(cfg.num_hidden_layers):
            for base in (kv.k(layer), kv.v(layer)):
                for src, dst in pairs:
                    drv.memcpy_dtod(base + dst * nbytes, base + src * nbytes, nbytes)
        drv.Context.synchronize()


def kv_block_bytes(cfg, block_size: int) -> int:
    """One block of one layer's K (or V): block_size rows of [kv_heads, head_dim] bf16."""
    return block_size * cfg.num_key_value_heads * cfg.head_dim * 2


PREFIX_BLOCKS, OWN_LENS, STEPS = 40, [1, 2, 5, 15, 16, 17, 30, 64, 100, 150, 600, 3], 24


def cache_blocks(block_size: int) -> int:
    """The KV blocks shared_and_private_greedy uses: the shared prefix and each sequence's own
    blocks, then a private copy of every sequence's table."""
    need = [-(-(n + STEPS) // block_size) for n in OWN_LENS]
    return PREFIX_BLOCKS + sum(need) + sum(PREFIX_BLOCKS + n for n in need)


def shared_and_private_greedy(runner, vocab: int, block_size: int, copy_blocks, rng):
    """The prompts (a PREFIX_BLOCKS-block prefix, then OWN_LENS tokens of their own) prefilled with
    the prefix in blocks every table shares, then STEPS greedy decode steps of them all over
    those tables (cascade), and again over private copies of every table's blocks (copy_blocks:
    [(source, destination)] of each block, every layer's K and V), whose K/V are those bits but
    no block of which is shared -> (prompts, {"cascade": tokens, "private": tokens}), each
    sequence's tokens from the prefill's on."""
    bs = block_size
    prefix = [int(t) for t in rng.integers(0, vocab, PREFIX_BLOCKS * bs)]
    owns = [[int(t) for t in rng.integers(0, vocab, n)] for n in OWN_LENS]
    shared_prefix, at, tables = list(range(PREFIX_BLOCKS)), PREFIX_BLOCKS, []
    for n in OWN_LENS:
        need = -(-(n + STEPS) // bs)
        tables.append(shared_prefix + list(range(at, at + need)))
        at += need
    runner.execute(ForwardBatch.build([prefix], [len(prefix)], [shared_prefix], bs, True), SamplingBatch.greedy(1))
    ctx = [len(prefix) + n for n in OWN_LENS]
    first = runner.execute(ForwardBatch.build(owns, ctx, tables, bs, True), SamplingBatch.greedy(len(owns)))
    private = []
    for t in tables:
        private.append(list(range(at, at + len(t))))
        at += len(t)
    copy_blocks([(src, dst) for t, pt in zip(tables, private) for src, dst in zip(t, pt)])
    runs = {}
    for name, tabs, shared in (("cascade", tables, PREFIX_BLOCKS), ("private", private, 0)):
        padded = np.array([t + [-1] * (max(map(len, tabs)) - len(t)) for t in tabs], np.int32)
        tokens, lens = [[int(t)] for t in first], list(ctx)
        for _ in range(STEPS):
            lens = [c + 1 for c in lens]
            batch = ForwardBatch.build_decode([t[-1] for t in tokens], lens, padded, bs)
            assert batch.common_prefix_blocks == shared, name
            for t, nxt in zip(tokens, runner.execute(batch, SamplingBatch.greedy(len(tokens)))):
                t.append(int(nxt))
        runs[name] = tokens
    return [prefix + own for own in owns], runs


def test_greedy_tokens_with_cascade_equal_those_over_private_copies(tiny_model_dir, small_cascade_rule):
    """12 sequences behind a shared 640-token prefix (40 blocks of 16) with 1..600 tokens of their
    own, decoded greedily for 24 steps through the runner's decode graph of 16 (4 padded rows):
    once over the shared blocks (common_prefix_blocks 40: cascade in every layer) and once over
    private copies of every block (bit-identical K/V; no shared block, so plain decode
    attention). The tokens must agree up to test_gpu_engine's near-tie rule."""
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import EngineConfig, ModelConfig
    from tinyvllm.gpu.cuda_runner import CudaRunner
    from tinyvllm.reference.model import ReferenceModel
    cfg, bs = ModelConfig.from_pretrained(tiny_model_dir), 16
    weights = load_weights(tiny_model_dir, cfg)
    refm = ReferenceModel(cfg, weights)
    runner = CudaRunner(cfg, weights, EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048,
                                                   num_kv_blocks=cache_blocks(bs), block_size=bs))
    try:
        prompts, runs = shared_and_private_greedy(runner, cfg.vocab_size, bs,
                                                  lambda pairs: _copy_blocks(runner, cfg, pairs), np.random.default_rng())
    finally:
        runner.close()
    diverged = [assert_same_greedy(refm, prompt, a, b, f"sequence {i} ({len(prompt)}-token prompt)")
                for i, (prompt, a, b) in enumerate(zip(prompts, runs["cascade"], runs["private"]))]
    print(f"near-tie divergences (cascade vs private copies): {sum(d is not None for d in diverged)} of {len(prompts)}")
