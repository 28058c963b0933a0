"""Which weight each of N tensor-parallel ranks holds: the one table of splits (SPLITS), over
the checkpoint's own tensor names (checkpoint/weight_names.py).

Megatron's layer split, so that each layer needs two all-reduces and nothing else:

  q_proj, k_proj, v_proj  column-parallel (split along their output rows) by heads: rank r
                          holds query heads Hq/N * r ... and the kv heads those query heads read;
                          its attention runs on its own heads alone. Their biases (Qwen2) split
                          with their rows; q_norm / k_norm ([head_dim], one for every head) are
                          replicated, so they apply per head on each shard unchanged.
  o_proj                  row-parallel (split along its input columns) by the same query heads:
                          each rank's product is a partial sum of the full one -> all-reduce.
  gate_proj, up_proj      column-parallel by intermediate rows: the activation is elementwise,
                          so each rank's silu(gate) * up is its slice of the full one.
  down_proj               row-parallel by the same intermediate columns -> all-reduce.
  embed_tokens, lm_head   vocab-parallel (split along the vocabulary rows): a rank's lookup gives
                          its own ids' rows and zeros elsewhere -> all-reduce (a sum with one
                          non-zero term per row: exact); its LM head gives its ids' logits, which
                          greedy sampling reduces to one (max, id) per rank and row
                          (parallel/vocab_parallel.py) instead of gathering them.
  every norm              replicated: each rank normalises the full residual stream it holds.

Uneven sizes. The intermediate size and the vocabulary are split in balanced shards: the first
total % N ranks hold one row more (never padding, never an empty shard: N may not exceed
either). Query heads must divide evenly (num_attention_heads % N == 0), and each rank's query
heads must read its kv heads in one regular pattern: either N divides the kv heads (each rank
holds num_key_value_heads / N of them) or the kv heads divide N (each kv head is replicated on
N / num_key_value_heads ranks, whose query heads all read it). Anything else is a ConfigError
saying which rule it breaks. On cuda N must also divide the intermediate size: every GPU rank's
layer then has one shape and takes the same kernels and collectives (check_engine_split).

A rank's model is the model itself at its own sizes: rank_config() is the ModelConfig with the
rank's head, intermediate and vocabulary counts, so the reference forward, expected_shapes() and
the GPU's weight plan (gpu/device_weights.py) all apply to a shard unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tinyvllm.checkpoint import weight_names as names
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.errors import ConfigError
from tinyvllm.quant.weight_kinds import is_quantized

# checkpoint tensor (the name after "model.layers.{i}.", or a whole-model name) ->
# (the axis split, what splits it); every tensor not named here is replicated on every rank
SPLITS: dict[str, tuple[int, str]] = {
    "self_attn.q_proj.weight": (0, "q_heads"), "self_attn.q_proj.bias": (0, "q_heads"),
    "self_attn.k_proj.weight": (0, "kv_heads"), "self_attn.k_proj.bias": (0, "kv_heads"),
    "self_attn.v_proj.weight": (0, "kv_heads"), "self_attn.v_proj.bias": (0, "kv_heads"),
    "self_attn.o_proj.weight": (1, "q_heads"),
    "mlp.gate_proj.weight": (0, "intermediate"), "mlp.up_proj.weight": (0, "intermediate"),
    "mlp.down_proj.weight": (1, "intermediate"),
    names.EMBED: (0, "vocab"), names.LM_HEAD: (0, "vocab"),
}
# where the partial sums are all-reduced (a sum over ranks, in rank order) in every forward
ALL_REDUCES = ("the embedding's output (once per step)", "each layer's o_proj output",
               "each layer's down_proj output")


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `size` holds, as index ranges of the full model's heads and rows."""
    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range

    def rows(self, by: str, head_dim: int) -> slice:
        """The slice of a split axis this rank holds (heads count head_dim rows each)."""
        r = getattr(self, by)
        step = head_dim if by in ("q_heads", "kv_heads") else 1
        return slice(r.start * step, r.stop * step)


def balanced(total: int, size: int, rank: int) -> range:
    """Rank `rank`'s share of `total` rows split over `size` ranks: the first total % size ranks
    hold one row more."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def check_split(config: ModelConfig, size: int) -> None:
    """A ConfigError line where this model cannot be split over `size` ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    if hq % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide num_attention_heads={hq}: "
                          "every rank must hold the same number of query heads")
    if hkv % size and size % hkv:
        raise ConfigError(f"tensor_parallel_size={size} and num_key_value_heads={hkv}: one must divide the "
                          "other (each rank holds whole kv heads, or shares one kv head with other ranks)")
    for what, total in (("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if total < size:
            raise ConfigError(f"tensor_parallel_size={size} exceeds {what}={total}: a rank would hold no rows")


def rank_shards(config: ModelConfig, size: int) -> list[RankShard]:
    """Every rank's shard, rank 0 first (check_split first)."""
    check_split(config, size)
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    per_rank, group = hq // size, hq // hkv
    shards = []
    for rank in range(size):
        q = range(rank * per_rank, (rank + 1) * per_rank)
        kv = range(q.start // group, (q.stop - 1) // group + 1)      # the kv heads its q heads read
        shards.append(RankShard(rank, size, q, kv, balanced(config.intermediate_size, size, rank),
                                balanced(config.vocab_size, size, rank)))
    return shards


def rank_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The ModelConfig of one rank's model: the full one at the rank's own sizes."""
    return dataclasses.replace(config, num_attention_heads=len(shard.q_heads),
                               num_key_value_heads=len(shard.kv_heads),
                               intermediate_size=len(shard.intermediate), vocab_size=len(shard.vocab))


def split_of(name: str) -> tuple[int, str] | None:
    """SPLITS' entry for a checkpoint tensor name (None: replicated)."""
    if name.startswith("model.layers."):
        name = name.split(".", 3)[3]
    return SPLITS.get(name)


def rank_weights(config: ModelConfig, weights: dict[str, np.ndarray], shard: RankShard) -> dict[str, np.ndarray]:
    """One rank's checkpoint tensors, by the same names, each the rank's slice (a view: nothing
    is copied here). Quantized weights are refused above one rank: their blocks and scales do not
    split along the axes above as plain arrays do."""
    if shard.size == 1:
        return dict(weights)                  # one rank holds everything, of any kind
    quantized = sorted(n for n, w in weights.items() if is_quantized(w))
    if quantized:
        raise ConfigError(f"tensor_parallel_size={shard.size} needs unquantized weights; {quantized[0]} "
                          f"is quantized ({len(quantized)} tensors are)")
    out = {}
    for name, w in weights.items():
        split = split_of(name)
        if split is None:
            out[name] = w
            continue
        axis, by = split
        cut = shard.rows(by, config.head_dim)
        out[name] = w[cut] if axis == 0 else w[:, cut]
    return out


def check_engine_split(config: ModelConfig, engine_config: EngineConfig, visible_gpus=None) -> None:
    """Before the weights load: the model splits over engine_config.tensor_parallel_size ranks,
    and the device has them. visible_gpus: a function counting the CUDA devices (tests)."""
    size = engine_config.tensor_parallel_size
    if size is None:
        return
    check_split(config, size)
    if size > 1 and engine_config.quantization:
        raise ConfigError(f"tensor_parallel_size={size} needs unquantized weights; --quantization "
                          f"{engine_config.quantization} quantizes them at load")
    if engine_config.device == "cuda":
        count = (visible_gpus or visible_gpu_count)()
        if size > count:
            raise ConfigError(f"tensor_parallel_size={size} but {count} GPU{'s are' if count != 1 else ' is'} "
                              "visible (CUDA_VISIBLE_DEVICES)")
    if engine_config.trace_steps and (size > 1 or engine_config.device == "cuda"):
        raise ConfigError("the trace follows one runner in the engine process; tensor_parallel_size splits "
                          "the work over ranks: trace without --tensor-parallel-size")
    if engine_config.device == "cuda" and size > 1:
        if config.hidden_size % 16:
            raise ConfigError(f"tensor_parallel_size={size} on cuda needs hidden_size % 16 == 0 (the residual add "
                              f"after each all-reduce works in 16-column chunks), got {config.hidden_size}")
        if config.intermediate_size % size:     # the kernels each rank picks follow its shapes
            raise ConfigError(f"tensor_parallel_size={size} on cuda needs it to divide intermediate_size="
                              f"{config.intermediate_size}: every rank's layer must have one shape, so that "
                              "every rank launches the same kernels and collectives")


def visible_gpu_count() -> int:
    """CUDA devices this process can see; 0 without PyCUDA or a driver."""
    try:
        import pycuda.driver as drv
        drv.init()
        return drv.Device.count()
    except Exception:  # noqa: BLE001 — no PyCUDA, no driver: no GPU to count
        return 0


def rank_memory_lines(config: ModelConfig, size: int, weight_itemsize: int = 2, kv_itemsize: int = 2) -> list[str]:
    """Each rank's share: its heads and rows, its weight bytes and its KV bytes per token."""
    lines = [f"  tensor_parallel_size {size}; all-reduced: {', '.join(ALL_REDUCES)}"]
    for shard in rank_shards(config, size):
        local = rank_config(config, shard)
        weight_bytes = sum(int(np.prod(s)) for s in names.expected_shapes(local).values()) * weight_itemsize
        kv = local.num_hidden_layers * 2 * local.kv_size * kv_itemsize
        lines.append(f"  rank {shard.rank}: q heads {_span(shard.q_heads)}, kv heads {_span(shard.kv_heads)}, "
                     f"intermediate {_span(shard.intermediate)}, vocab {_span(shard.vocab)}; weights "
                     f"{weight_bytes:,} bytes, KV {kv:,} bytes per token")
    return lines


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)
