"""Tensor parallelism's numpy twin (tinyvllm/parallel/): the sharded forward over N ranks equals
the unsharded reference within the fp32 reordering bound (tests/test_reference.py's
fp32_reorder_bound, derived from the sums' lengths and fp32's unit roundoff: the shards change
only the order of the o_proj and down_proj sums), the greedy argmax reduced across ranks is the
gathered row's argmax, and the splits cover every weight exactly once."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_reference import fp32_reorder_bound

from tinyvllm.checkpoint.weight_names import expected_shapes
from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.errors import ConfigError
from tinyvllm.parallel.numpy_ranks import RankGroup, ShardedReferenceModel
from tinyvllm.parallel.sharding import check_split, rank_config, rank_shards, rank_weights, split_of
from tinyvllm.parallel.vocab_parallel import gather_vocab, ids_from_keys, shard_argmax_keys
from tinyvllm.reference.model import ReferenceModel
from tinyvllm.reference.sampling import sample

FAMILIES = Path(__file__).parent / "fixtures" / "families"


def synthetic_config(**fields) -> ModelConfig:
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=102, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
               rope_theta=10000.0, max_position_embeddings=256, vocab_size=1001, eos_token_id=0)
    cfg.update(fields)
    return ModelConfig.from_dict(cfg, "test config")


def random_weights(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * (0.5 if name.endswith("bias") else 0.08)).astype(np.float32)
    return out


# uneven shapes: vocabulary 1001 and intermediate 102 split in balanced shards; 2 kv heads over
# 4 or 8 ranks are replicated; Qwen2's biases split with their rows
ODD = synthetic_config()
ODD_QWEN2 = synthetic_config(model_type="qwen2", num_key_value_heads=1, intermediate_size=97)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_weights(tiny_model_dir, config)
    return config, weights, ReferenceModel(config, weights)


def assert_within_bound(got, want, bound, what):
    excess = np.abs(got - want) - bound
    assert excess.max() <= 0, f"{what}: beyond the fp32 reordering bound by {excess.max():.3g}"


def check_dense_and_paged(config, weights, reference, size, seed):
    """Dense recompute and a paged prefill + decode, sharded vs unsharded, every logit in bound;
    the greedy ids reduced across ranks equal the unsharded sampler's."""
    rng = np.random.default_rng(seed)
    sharded = ShardedReferenceModel(config, weights, size)
    seqs = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (11, 6)]
    for seq in seqs:
        bound = fp32_reorder_bound(reference, reference.hidden_full(seq))
        assert_within_bound(sharded.forward_full(seq), reference.forward_full(seq), bound, f"dense N={size}")
    block_size, num_blocks = 4, 12
    tables = [[int(b) for b in t] for t in np.split(rng.permutation(num_blocks), 2)]
    caches, cache = sharded.new_kv_caches(num_blocks, block_size), reference.new_kv_cache(num_blocks, block_size)
    steps = [ForwardBatch.build([s[:-2] for s in seqs], [len(s) - 2 for s in seqs], tables, block_size, True)]
    steps += [ForwardBatch.build([[s[-i]] for s in seqs], [len(s) - i + 1 for s in seqs], tables, block_size, False)
              for i in (2, 1)]
    for i, batch in enumerate(steps):
        shards, want = sharded.forward(batch, caches), reference.forward(batch, cache)
        for row, seq in enumerate(seqs):
            pos = int(batch.context_lens[row]) - 1
            bound = fp32_reorder_bound(reference, reference.hidden_full(seq[:pos + 1]))[pos]
            assert_within_bound(gather_vocab(shards)[row], want[row], bound, f"paged step {i} N={size}")
        greedy = SamplingBatch.build([0, 0], [0, 0], [1, 1], [0, 0], [0, 0])
        np.testing.assert_array_equal(sharded.greedy_ids(shards), sample(want.copy(), greedy))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_tiny_preset_sharded_equals_unsharded(tiny, size):
    check_dense_and_paged(*tiny, size, seed=size)


@pytest.mark.parametrize("config,size", [(ODD, 2), (ODD, 4), (ODD, 8), (ODD_QWEN2, 2), (ODD_QWEN2, 4)],
                         ids=["llama-N2", "llama-N4", "llama-N8", "qwen2-N2", "qwen2-N4"])
def test_uneven_shapes_sharded_equals_unsharded(config, size):
    weights = random_weights(config, seed=size)
    check_dense_and_paged(config, weights, ReferenceModel(config, weights), size, seed=size + 10)


@pytest.mark.parametrize("family,size", [("gemma3", 2), ("mistral", 2), ("mistral", 4), ("qwen2", 4), ("qwen3", 2)])
def test_family_fixtures_sharded_equal_unsharded(family, size):
    """q_norm / k_norm per head on each shard, Gemma's sandwich norms after the all-reduce, its
    scaled embedding, Mistral's windows: each family's differences survive the split."""
    config = ModelConfig.from_pretrained(FAMILIES / family)
    weights = load_weights(FAMILIES / family, config)
    check_dense_and_paged(config, weights, ReferenceModel(config, weights), size, seed=size)


@pytest.mark.parametrize("config,size", [(ODD, 1), (ODD, 2), (ODD, 4), (ODD, 8), (ODD_QWEN2, 4),
                                         (synthetic_config(num_attention_heads=12, num_key_value_heads=6), 3)])
def test_shards_cover_every_weight_once_at_the_rank_configs_shapes(config, size):
    weights = random_weights(config, seed=0)
    shards = rank_shards(config, size)
    group = config.num_attention_heads // config.num_key_value_heads
    parts = [rank_weights(config, weights, s) for s in shards]
    for shard, part in zip(shards, parts):
        assert {n: w.shape for n, w in part.items()} == expected_shapes(rank_config(config, shard))
        assert list(shard.kv_heads) == sorted({h // group for h in shard.q_heads})   # what its q heads read
    for name, w in weights.items():
        split = split_of(name)
        if split is None:
            assert all(p[name] is w for p in parts)                # replicated
        elif split[1] == "kv_heads" and size > config.num_key_value_heads:
            copies = size // config.num_key_value_heads            # each kv head on N / kv ranks
            np.testing.assert_array_equal(np.concatenate([p[name] for p in parts[::copies]], split[0]), w)
        else:
            np.testing.assert_array_equal(np.concatenate([p[name] for p in parts], split[0]), w)
    assert {len(s.vocab) for s in shards} <= {config.vocab_size // size, config.vocab_size // size + 1}


@pytest.mark.parametrize("config,size,says", [
    (ODD, 3, "does not divide num_attention_heads=8"),
    (synthetic_config(num_attention_heads=12, num_key_value_heads=3), 4, "num_key_value_heads=3: one must divide"),
    (synthetic_config(num_attention_heads=12, num_key_value_heads=3), 2, "num_key_value_heads=3: one must divide"),
    (synthetic_config(num_attention_heads=16, intermediate_size=8), 16, "exceeds intermediate_size=8"),
    (ODD, 0, "positive integer"), (ODD, -2, "positive integer")])
def test_splits_that_cannot_work_are_refused_in_one_line(config, size, says):
    with pytest.raises(ConfigError, match=says) as e:
        check_split(config, size)
    assert "\n" not in str(e.value)


def test_quantized_weights_are_refused_above_one_rank():
    from tinyvllm.quant.fp8 import quantize_per_channel
    weights = random_weights(ODD, seed=0)
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = quantize_per_channel(weights[name], name)
    with pytest.raises(ConfigError, match="needs unquantized weights; model.layers.0.mlp.down_proj.weight"):
        rank_weights(ODD, weights, rank_shards(ODD, 2)[0])
    assert rank_weights(ODD, weights, rank_shards(ODD, 1)[0])[name] is weights[name]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 11])
def test_reduced_argmax_is_the_gathered_rows_argmax(rng, size):
    """Ties across shards go to the lowest id; NaN, +inf or no finite logit anywhere in the row is
    NON_FINITE, as the unsharded sampler says."""
    vocab = 11
    logits = rng.integers(-3, 3, (9, vocab)).astype(np.float32)   # many ties, across shard edges
    logits[1, 7] = np.nan
    logits[2, 0] = np.inf
    logits[3] = -np.inf
    logits[4, [2, 9]] = 5                                          # a tie between two shards
    logits[5] = -0.0
    logits[5, 6] = 0.0                                             # -0 == +0: the lowest id wins
    logits[6, 10] = np.nan
    logits[6, 0] = np.inf
    logits[7, :] = -np.inf
    logits[7, 10] = -1e30
    config = synthetic_config(vocab_size=vocab, num_attention_heads=size, num_key_value_heads=1,
                              intermediate_size=64)
    starts = [s.vocab.start for s in rank_shards(config, size)] + [vocab]
    keys = [shard_argmax_keys(logits[:, a:b], a) for a, b in zip(starts, starts[1:])]
    greedy = SamplingBatch.build([0] * 9, [0] * 9, [1] * 9, [0] * 9, [0] * 9)
    np.testing.assert_array_equal(ids_from_keys(keys), sample(logits.copy(), greedy))


def test_rank_group_sums_in_rank_order_and_passes_errors_on():
    group = RankGroup(3)
    parts = [np.float32(1e8), np.float32(1.0), np.float32(-1e8)]     # order matters in fp32
    got = group.run(lambda r: group.all_reduce(r, np.array([parts[r]])))
    assert all(g[0] == (parts[0] + parts[1]) + parts[2] for g in got)
    assert len({g.tobytes() for g in got}) == 1

    def failing(rank):
        if rank == 1:
            raise KeyError("rank 1 failed")
        return group.all_reduce(rank, np.zeros(1))
    with pytest.raises(KeyError, match="rank 1 failed"):
        group.run(failing)
    assert group.run(lambda r: group.all_reduce(r, np.ones(1)))[0][0] == 3     # usable again
