"""The launchers of the two attention kernels: prefill over query tiles on the tensor cores
(attention_prefill.cu) and decode split over the context (attention_decode.cu)."""
from __future__ import annotations

import math

from tinyvllm.gpu.kernels import kernel_constants
from tinyvllm.gpu.ops.launch import OpsBase

PREFILL = kernel_constants("attention_prefill.cu")
DECODE = kernel_constants("attention_decode.cu")
DECODE_HEAD_DIMS, DECODE_GROUPS = (64, 128), (1, 2, 3, 4, 8)   # instantiated in attention_decode.cu
PREFILL_HEAD_DIMS = (64, 128)                                  # instantiated in attention_prefill.cu
MAX_DECODE_SPLITS = DECODE["MAX_SPLITS"]   # flash-decoding splits per sequence; the arena sizes its workspace by it


class AttentionOps(OpsBase):
    def attention_prefill(self, out, q, q_row_stride: int, k_cache, v_cache, block_tables,
                          block_table_width, query_start, context_lens, *, num_seqs: int,
                          max_query_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int, scale: float) -> None:
        """Causal attention of each prompt token over its sequence's cached and new K/V, on the
        tensor cores. Grid: (query heads, sequences, query tiles of BLOCK_Q rows), the kernel
        walking the tiles last-first; THREADS (4 warps x 16 rows) per block, static shared memory."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"attention_prefill: block_size must be a power of two, got {block_size}")
        grid = (num_q_heads, num_seqs, math.ceil(max_query_len / PREFILL["BLOCK_Q"]))
        self._launch(f"attention_prefill_d{head_dim}", grid, PREFILL["THREADS"],
                     out, q, q_row_stride, k_cache, v_cache, block_tables, block_table_width,
                     query_start, context_lens, block_size, num_kv_heads, num_q_heads // num_kv_heads, scale)

    def decode_splits(self, num_seqs: int, num_kv_heads: int) -> int:
        """The most context splits a sequence may use: enough blocks to fill the GPU about twice.
        It depends on the batch size only, so eager steps and graph replays run identical
        launches (bit-identical results); the kernel itself uses fewer for short contexts
        (one per MIN_SPLIT_TOKENS)."""
        return max(1, min(math.ceil(2 * self.num_sms / (num_seqs * num_kv_heads)), MAX_DECODE_SPLITS))

    def attention_decode(self, out, partial_out, partial_ml, split_counters, q, q_row_stride: int,
                         k_cache, v_cache, block_tables, block_table_width, context_lens, *,
                         num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         block_size: int, scale: float, splits: int | None = None) -> None:
        """One query token per sequence over its paged context, split over the context; the last
        split to finish merges. Grid: (sequences x kv heads, 1, splits); one block per GQA group,
        SMEM_BYTES_PER_DIM x head_dim bytes of dynamic shared memory (its cp.async rings). The
        kernel issues its first K/V copies, all rows but each sequence's newest, before it waits
        for the kernel before it (attention_decode.cu's header: early K/V), so its launches must
        be decode steps', where that row is the only one a still-running kernel writes."""
        splits = splits or self.decode_splits(num_seqs, num_kv_heads)
        if not 1 <= splits <= MAX_DECODE_SPLITS:
            raise ValueError(f"attention_decode: splits must be in 1..{MAX_DECODE_SPLITS}, got {splits}")
        self._launch(f"attention_decode_d{head_dim}_g{num_q_heads // num_kv_heads}",
                     (num_seqs * num_kv_heads, 1, splits), DECODE["THREADS"], out, partial_out,
                     partial_ml, split_counters, q, q_row_stride, k_cache, v_cache, block_tables,
                     block_table_width, context_lens, block_size, num_kv_heads, scale,
                     shared_bytes=DECODE["SMEM_BYTES_PER_DIM"] * head_dim)
