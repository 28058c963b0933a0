"""The launchers of the attention kernels: prefill over query tiles on the tensor cores
(attention_prefill.cu), decode split over the context (attention_decode.cu), and cascade
decode's shared-prefix part (attention_cascade.cu), which merges into decode's output. Prefill
and decode each have a full-context kernel and, for sliding-window layers
(ModelConfig.layer_window), a window one; cascade serves full-context layers only."""
from __future__ import annotations

import math

from tinyvllm.gpu.kernels import kernel_constants, kernel_instances
from tinyvllm.gpu.ops.launch import OpsBase

PREFILL = kernel_constants("attention_prefill.cu")
DECODE = kernel_constants("attention_decode.cu")
CASCADE = kernel_constants("attention_cascade.cu")
# (head_dim, query heads per kv head) of every decode kernel, and the prefill kernels' head dims:
# the instantiation lines of the .cu files
DECODE_SHAPES = frozenset((int(d), int(g)) for d, g in kernel_instances("attention_decode.cu", "DECODE_ATTENTION_KERNEL"))
PREFILL_HEAD_DIMS = tuple(int(args[0]) for args in kernel_instances("attention_prefill.cu", "PREFILL_ATTENTION_KERNEL"))
CASCADE_HEAD_DIMS = tuple(int(args[0]) for args in kernel_instances("attention_cascade.cu", "CASCADE_PREFIX_KERNEL"))
MAX_DECODE_SPLITS = DECODE["MAX_SPLITS"]   # flash-decoding splits per sequence; the arena sizes its workspace by it
MAX_CASCADE_SPLITS = CASCADE["MAX_SPLITS"]   # prefix splits per q tile; the arena sizes its workspace by it


def attention_kernels_missing(head_dim: int, num_q_heads: int, num_kv_heads: int) -> str | None:
    """Why no attention kernels serve this head shape (None: they do), checked before the GPU starts."""
    group = num_q_heads // num_kv_heads
    if head_dim in PREFILL_HEAD_DIMS and head_dim in CASCADE_HEAD_DIMS and (head_dim, group) in DECODE_SHAPES:
        return None
    built = ", ".join(f"{d}/{g}" for d, g in sorted(DECODE_SHAPES))
    return (f"no attention kernels for head_dim {head_dim} with {group} query heads per kv head (built, "
            f"head_dim/group: {built}; prefill head_dim {', '.join(map(str, PREFILL_HEAD_DIMS))}; "
            f"cascade head_dim {', '.join(map(str, CASCADE_HEAD_DIMS))})")


def decode_block(head_dim: int) -> tuple[int, int]:
    """(threads, dynamic shared bytes) of a decode block: attention_decode.cu's decode_threads and
    decode_smem_bytes (4 warps at head_dim 256, whose 8 warps' rings would not fit an SM)."""
    wide = head_dim >= DECODE["WIDE_HEAD_DIM"]
    threads = DECODE["WIDE_THREADS"] if wide else DECODE["THREADS"]
    return threads, (DECODE["WIDE_SMEM_BYTES_PER_DIM"] if wide else DECODE["SMEM_BYTES_PER_DIM"]) * head_dim


def cascade_block(head_dim: int) -> tuple[int, int]:
    """(threads, dynamic shared bytes) of a cascade prefix block: attention_cascade.cu's
    cascade_smem_bytes (STAGES K and V tiles of padded rows; WIDE_TILE_K keys a tile from
    WIDE_HEAD_DIM on)."""
    keys = CASCADE["WIDE_TILE_K"] if head_dim >= CASCADE["WIDE_HEAD_DIM"] else CASCADE["TILE_K"]
    return CASCADE["THREADS"], CASCADE["STAGES"] * 2 * keys * (head_dim + CASCADE["ROW_PAD"]) * 2


def cascade_q_tiles(num_seqs: int, num_q_heads: int, num_kv_heads: int) -> int:
    """The prefix kernel's q tiles per kv head: BLOCK_Q of the num_seqs * group rows each."""
    return math.ceil(num_seqs * (num_q_heads // num_kv_heads) / CASCADE["BLOCK_Q"])


def cascade_tiles(num_seqs: int, num_q_heads: int, num_kv_heads: int) -> int:
    """The prefix kernel's (q tile, kv head) pairs: its CTAs a split, and its workspace's rows."""
    return cascade_q_tiles(num_seqs, num_q_heads, num_kv_heads) * num_kv_heads


def _window_arg(window: int | None) -> tuple:
    """The window kernels' extra argument (a window of 0 or None: the full-context kernel, none)."""
    if window is not None and window < 0:
        raise ValueError(f"attention: window must be >= 0 (0: the whole context), got {window}")
    return (int(window),) if window else ()


class AttentionOps(OpsBase):
    def attention_prefill(self, out, q, q_row_stride: int, k_cache, v_cache, block_tables,
                          block_table_width, query_start, context_lens, *, num_seqs: int,
                          max_query_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int, scale: float, window: int | None = None) -> None:
        """Causal attention of each prompt token over its sequence's cached and new K/V, on the
        tensor cores; scores times `scale`. window (a sliding layer's; None or 0: the whole
        context): each token sees its last `window` positions, its own included. Grid: (query
        heads, sequences, query tiles of BLOCK_Q rows), the kernel walking the tiles last-first;
        THREADS (4 warps x 16 rows) per block, static shared memory."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"attention_prefill: block_size must be a power of two, got {block_size}")
        grid = (num_q_heads, num_seqs, math.ceil(max_query_len / PREFILL["BLOCK_Q"]))
        extra = _window_arg(window)
        kernel = f"attention_prefill_window_d{head_dim}" if extra else f"attention_prefill_d{head_dim}"
        self._launch(kernel, grid, PREFILL["THREADS"],
                     out, q, q_row_stride, k_cache, v_cache, block_tables, block_table_width,
                     query_start, context_lens, block_size, num_kv_heads, num_q_heads // num_kv_heads, scale,
                     *extra)

    def decode_splits(self, num_seqs: int, num_kv_heads: int) -> int:
        """The most context splits a sequence may use: enough blocks to fill the GPU about twice.
        It depends on the batch size only, so eager steps and graph replays run identical
        launches (bit-identical results); the kernel itself uses fewer for short contexts
        (one per MIN_SPLIT tokens: 16 per warp)."""
        return max(1, min(math.ceil(2 * self.num_sms / (num_seqs * num_kv_heads)), MAX_DECODE_SPLITS))

    def attention_decode(self, out, partial_out, partial_ml, split_counters, q, q_row_stride: int,
                         k_cache, v_cache, block_tables, block_table_width, context_lens, *,
                         num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         block_size: int, scale: float, splits: int | None = None,
                         window: int | None = None, first_position=0, lse_out=0) -> None:
        """One query token per sequence over its paged context, split over the context; the last
        split to finish merges; scores times `scale`. window (a sliding layer's; None or 0: the
        whole context): only the last `window` positions are read, from the block holding the
        first of them. Grid: (sequences x kv heads, 1, splits); one block per GQA group of
        decode_block(head_dim) threads and dynamic shared memory (its cp.async rings). The
        kernel issues its first K/V copies, all rows but each sequence's newest, before it waits
        for the kernel before it (attention_decode.cu's header: early K/V), so its sequences must
        be decode rows (a decode step's, or a mixed step's leading ones), whose newest row is
        the only one of theirs a still-running kernel writes.

        Cascade's suffix (attention_decode.cu's header), both device pointers, 0 for none:
        first_position, one int32 the kernel reads (a shared prefix's length): every sequence
        attends from that position on; lse_out, fp32 [num_seqs, num_q_heads]: the base-2
        log-sum-exp of what each (sequence, head) attended to (-inf for nothing)."""
        splits = splits or self.decode_splits(num_seqs, num_kv_heads)
        if not 1 <= splits <= MAX_DECODE_SPLITS:
            raise ValueError(f"attention_decode: splits must be in 1..{MAX_DECODE_SPLITS}, got {splits}")
        group = num_q_heads // num_kv_heads
        extra = _window_arg(window)
        kernel = (f"attention_decode_window_d{head_dim}_g{group}" if extra
                  else f"attention_decode_d{head_dim}_g{group}")
        threads, shared = decode_block(head_dim)
        self._launch(kernel, (num_seqs * num_kv_heads, 1, splits), threads, out, partial_out,
                     partial_ml, split_counters, lse_out, q, q_row_stride, k_cache, v_cache, block_tables,
                     block_table_width, context_lens, first_position, block_size, num_kv_heads, scale, *extra,
                     shared_bytes=shared)

    def cascade_splits(self, num_seqs: int, num_q_heads: int, num_kv_heads: int) -> int:
        """The prefix splits of attention_cascade_prefix's grid: enough CTAs (q tiles x kv heads x
        splits) to fill the GPU about twice, at most MAX_CASCADE_SPLITS. It depends on the batch
        size only, as a captured graph needs; the kernel cuts the prefix it finds into at most that
        many splits of at least MIN_SPLIT_KEYS keys (attention_cascade.cu's header: splits)."""
        tiles = cascade_tiles(num_seqs, num_q_heads, num_kv_heads)
        return max(1, min(math.ceil(2 * self.num_sms / tiles), MAX_CASCADE_SPLITS))

    def attention_cascade_prefix(self, out, lse, partial_o, partial_ml, split_counters, q, q_row_stride: int,
                                 k_cache, v_cache, block_tables, prefix_len, *, num_seqs: int, num_q_heads: int,
                                 num_kv_heads: int, head_dim: int, block_size: int, scale: float,
                                 splits: int | None = None) -> None:
        """Cascade decode's shared-prefix part, launched right after attention_decode(first_position=
        prefix_len, lse_out=lse) on the same buffers: every sequence's query heads against the first
        *prefix_len positions of block_tables row 0 (the blocks every row shares), merged into
        `out` with attention_decode's (out, lse); *prefix_len = 0: nothing (decode read whole
        contexts). prefix_len is a device pointer (one int32), so a captured graph serves every
        prefix. Grid: (q tiles of BLOCK_Q rows out of num_seqs * group, kv heads, splits), fixed by
        the batch size (splits: cascade_splits() unless given); cascade_block(head_dim) threads and
        dynamic shared memory. With several splits each stores its partial to partial_o
        ([tiles, splits, BLOCK_Q, head_dim] fp32, tiles = q tiles x kv heads) and partial_ml
        ([tiles, splits, BLOCK_Q, 2]), and the last to finish a tile merges them (split_counters
        [tiles] int32, zero before the first launch, left at zero). It copies prefix K/V before it
        waits for attention_decode (attention_cascade.cu's header): no kernel of the step may write
        the prefix's rows."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"attention_cascade_prefix: block_size must be a power of two, got {block_size}")
        if head_dim not in CASCADE_HEAD_DIMS:
            raise ValueError(f"attention_cascade_prefix: no kernel for head_dim {head_dim} "
                             f"(built: {', '.join(map(str, CASCADE_HEAD_DIMS))})")
        splits = splits or self.cascade_splits(num_seqs, num_q_heads, num_kv_heads)
        if not 1 <= splits <= MAX_CASCADE_SPLITS:
            raise ValueError(f"attention_cascade_prefix: splits must be in 1..{MAX_CASCADE_SPLITS}, got {splits}")
        group = num_q_heads // num_kv_heads
        threads, shared = cascade_block(head_dim)
        grid = (cascade_q_tiles(num_seqs, num_q_heads, num_kv_heads), num_kv_heads, splits)
        self._launch(f"attention_cascade_prefix_d{head_dim}", grid, threads, out, lse, partial_o, partial_ml,
                     split_counters, q, q_row_stride, k_cache, v_cache, block_tables, prefix_len, num_seqs,
                     block_size, num_kv_heads, group, scale, shared_bytes=shared)
