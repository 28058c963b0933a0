"""One typed launcher per CUDA kernel: what the model, the GPU tests and the benchmarks call.

Each launcher owns its kernel's launch geometry, computed from the constants its .cu file
defines (read by gpu/kernels.py, never copied), and passes the arguments in the kernel's own
order; the argument types come from the kernel's C signature. Every launch goes through
`GpuOps._launch` and every projection through `linear()` (the fused decode GEMVs are launches of
their own kernels): an `observer` set on GpuOps sees each op once, in order, with a
callable that repeats it (benchmarks/decode_profile.py times ops so; trace.py prints them).

    kernel (gpu/cuda/)                 launcher              numpy twin (tinyvllm/reference/)    GPU test (tests/)
    embedding.cu      embedding_gather embedding()           kernels.embedding                  test_gpu_kernels::test_embedding_gather
    rmsnorm.cu        rms_norm         rms_norm()            kernels.rms_norm                   test_gpu_kernels::test_rms_norm
    rope_kv.cu        rope_write_kv    rope_write_kv()       kernels.apply_rope + write_kv      test_gpu_kernels::test_rope_write_kv
    attention_prefill attention_prefill_d{64,128}  attention_prefill()  kernels.paged_attention  test_gpu_kernels::test_attention_prefill
    attention_decode  attention_decode_d{64,128}_g{G}  attention_decode()  kernels.paged_attention  test_gpu_kernels::test_attention_decode
    activation.cu     silu_mul         silu_mul()            kernels.silu_mul                   test_gpu_kernels::test_silu_mul
    gemv.cu           gemv_bf16        gemv() (via linear()) X @ W^T in numpy                   test_gpu_gemv
    gemv.cu           gemv_[norm_]rope_kv_bf16   gemv_rope_kv()   [rms_norm_]linear, apply_rope + write_kv  test_gpu_fused::test_rope_kv
    gemv.cu           gemv_[norm_]silu_mul_bf16  gemv_silu_mul()  [rms_norm_]linear, silu_mul  test_gpu_fused::test_silu_mul
    gemv.cu           gemv_residual_norm_bf16, gemv_prenormed_{rope_kv,silu_mul,}_bf16  gemv_residual_norm(),
                      gemv_rope_kv() / gemv_silu_mul() / gemv() with prenormed  rms_norm_operand, rms_norm_linear
                                                                                          test_gpu_fused::test_handed_over_norm
    sampling.cu       sample_tokens    sample()              sampling.sample                    test_gpu_sampling
    sampling.cu       apply_logit_edits apply_logit_edits()  sampling.apply_edits               test_gpu_logit_processing
    sampling.cu       step_logprobs    step_logprobs()       sampling.step_logprobs             test_gpu_logit_processing
    (cuBLAS)          cublasGemmEx     linear()              X @ W^T in numpy                   test_gpu_kernels::test_linear

The fused decode layer (`fuse`, on by default; TINYVLLM_FUSE=0 turns it off): when every
projection of a step runs on the GEMV (decode, m <= 8), a layer is five launches (seven
where the norms stay outside) instead of nine — gemv_norm_rope_kv (rms_norm + qkv + rope_write_kv), attention, gemv o (+ residual),
gemv_norm_silu_mul (rms_norm + gate_up + silu_mul), gemv down (+ residual). The norms inside
take their scale out of the dot product (gemv.cu's header), which changes bits against the
nine: test_gpu_fused holds them to their numpy twin, test_gpu_model the model to the reference.
Where a norm goes inside is fuses_norm()'s measured rule (by default only small GEMVs: it won
on SmolLM2's shapes and lost on Llama-1B's); TINYVLLM_FUSE_NORM=all|none overrides it. A norm
left outside is a separate rms_norm launch, with the bits of the nine (common.cuh shares the
arithmetic of RoPE and silu_mul). TINYVLLM_FUSE_NORM=producer (the default, model.py) hands
the norms over to the kernel before them instead (gemv_residual_norm or, for the first layer's
input norm, the embedding gather; then prenormed GEMVs, the LM head included): a decode step
then launches no rms_norm at all.

TINYVLLM_L2_PREFETCH=1 makes the fused layer's attention prefetch the o weight and the start of
gate_up into L2 while it runs (attention_decode's l2_prefetch; model.py says why). Off by
default: it measured no gain (docs/perf-notes.md, session 7). Timing only: the same bits either way.

The decode attention issues its first K/V copies (all rows but each sequence's newest) before it
waits for the qkv GEMV under PDL (attention_decode.cu's header, the launcher's early_kv): the same
bits (tests/test_gpu_kernels.py, test_gpu_model.py), 22-54 us less GPU time per step at batch 1
(docs/perf-notes.md, session 8). TINYVLLM_ATTN_EARLY_KV=0 turns it off.

`linear()` is THE projection: Y[m, n] (+)= X[m, k] @ W[n, k]^T, on our GEMV for decode batches of
at most GEMV_MAX_ROWS rows (cuBLAS reads small matrices at 1.7-2.5 TB/s at M <= 8; the GEMV
streams them at 3.5+), else on cuBLAS (gpu/cublas.py has the row-major/column-major derivation).
"""
from __future__ import annotations

import math
import os

from tinyvllm.gpu.kernels import KernelLibrary, kernel_constants

# TINYVLLM_FUSE_NORM when unset: each norm after a residual GEMV is handed over by it (model.py);
# the first input norm goes inside the GEMV after it where fuses_norm() says. Measured (H100,
# session 11, docs/perf-notes.md): Llama-1B 975 -> 1,004 decode tok/s, SmolLM2-135M 2,236 -> 2,276.
FUSE_NORM_DEFAULT = "producer"
# fuses_norm()'s "auto" bound on ceil(n / 16) * k, the x values a norm-inside GEMV re-reads and
# scales (every CTA does all of x). Measured on the H200 (docs/perf-notes.md, session 7), batch 1,
# every norm inside vs none: SmolLM2-135M's shapes (qkv 34,560, gate_up 110,592) gained 36-47 us
# per token; Llama-3.2-1B's (qkv 393,216, gate_up 2,097,152) lost 44 us of graph GPU time. The
# bound sits between the two.
NORM_INSIDE_MAX_VALUES = 1 << 18
EMBEDDING = kernel_constants("embedding.cu")
RMS_NORM = kernel_constants("rmsnorm.cu")
ROPE = kernel_constants("rope_kv.cu")
SILU = kernel_constants("activation.cu")
PREFILL = kernel_constants("attention_prefill.cu")
DECODE = kernel_constants("attention_decode.cu")
GEMV = kernel_constants("gemv.cu")
SAMPLING = kernel_constants("sampling.cu")

DECODE_HEAD_DIMS, DECODE_GROUPS = (64, 128), (1, 2, 3, 4, 8)   # instantiated in attention_decode.cu
PREFILL_HEAD_DIMS = (64, 128)                                  # instantiated in attention_prefill.cu
MAX_ARGMAX_SLICES = SAMPLING["MAX_ARGMAX_SLICES"]   # the sampler's argmax blocks per row; sizes its workspace
MAX_DECODE_SPLITS = DECODE["MAX_SPLITS"]   # flash-decoding splits per sequence; the arena sizes its workspace by it
GEMV_MAX_ROWS = 8            # the GEMV's m limit (x rows held in one m16n8k16 tile's n = 8)
GEMV_MAX_K = 1 << 26         # its int step arithmetic (steps * warps) stays below 2^31
GEMV_WARPS_PER_SM = 32       # residency at its 64 registers per thread
GEMV_MIN_STEPS_PER_WARP = 2  # gemv_k_warps(): the fewest 32-wide k steps a warp is left with
# The o GEMV's most k-split warps (gemv_k_warps' beside_attention): at 32 warps a CTA takes an
# SM's whole register file, so under PDL none can be resident on an SM that holds one of the
# decode attention's blocks, and those CTAs start (and stream their W) only after it ends. At 16
# all of Llama-1B's 128 o CTAs sit beside the attention with their W already in their rings:
# 1,004 -> 1,014 decode tok/s (H100, session 11). Smaller o GEMVs (SmolLM2: 8 warps) are unchanged.
GEMV_BESIDE_ATTENTION_WARPS = GEMV_WARPS_PER_SM // 2
GEMV_WIDE_L2_MIN_STEPS = 16  # gemv_wide_l2(): the steps per warp from which the .L2::256B hint pays
# The LM head runs on the GEMV too (gemv_k_warps' `last` rule): alone 121 us against cuBLAS's
# 127 on Llama-1B's 525 MB head (a tie inside its decode graph), and SmolLM2's decode graph
# 15-20 us shorter, where the cuBLAS kernel broke the PDL chain (docs/perf-notes.md, session 8);
# the bound is the kernel's int arithmetic (n * k elements indexed as size_t, n itself an int).
GEMV_MAX_N = 1 << 30
OUT_DTYPES = {"bfloat16": 0, "float32": 1}


def _dim3(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(int(x) for x in d)
    return d + (1,) * (3 - len(d))


DECODE_PROJECTIONS = ("qkv", "o", "gate_up", "down")   # the decode layer's GEMVs, by name
K_WARPS_CHOICES = range(1, GEMV["MAX_K_WARPS"] + 1)   # the kernel splits K over any warp count


def parse_k_warps_for(spec: str) -> dict[str, int]:
    """TINYVLLM_GEMV_K_WARPS ("o=16,down=16"; empty: none) -> {projection: k-split warps}."""
    table = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, warps = item.partition("=")
        if name not in DECODE_PROJECTIONS or not warps.isdigit() or int(warps) not in K_WARPS_CHOICES:
            raise ValueError(f"TINYVLLM_GEMV_K_WARPS: {item!r} is not projection=warps with a projection in "
                             f"{DECODE_PROJECTIONS} and warps from 1 to {GEMV['MAX_K_WARPS']}")
        table[name] = int(warps)
    return table


class GpuOps:
    """The launchers, bound to one kernel library, stream, cuBLAS handle and SM count."""

    def __init__(self, library: KernelLibrary, stream=None, blas=None, num_sms: int | None = None,
                 use_gemv: bool | None = None, pdl: bool | None = None,
                 fuse: bool | None = None):
        if num_sms is None:
            import pycuda.driver as drv
            num_sms = drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        self.library, self.stream, self.blas, self.num_sms = library, stream, blas, int(num_sms)
        # TINYVLLM_GEMV=0 sends every projection to cuBLAS (for comparisons)
        self.use_gemv = os.environ.get("TINYVLLM_GEMV", "1") != "0" if use_gemv is None else use_gemv
        # programmatic dependent launch of our kernels (gpu/kernels.py); TINYVLLM_PDL=0 turns it off
        self.pdl = os.environ.get("TINYVLLM_PDL", "1") != "0" if pdl is None else pdl
        # the fused decode layer (module docstring; model.py); TINYVLLM_FUSE=0 runs the nine
        # separate launches per layer instead (the same bits)
        self.fuse = os.environ.get("TINYVLLM_FUSE", "1") != "0" if fuse is None else fuse
        self.fuse_norm = os.environ.get("TINYVLLM_FUSE_NORM", FUSE_NORM_DEFAULT)   # fuses_norm()
        # TINYVLLM_L2_PREFETCH=1: the fused decode layer's attention prefetches the next weights
        # into L2 (model.py); off by default, it measured no gain (the same bits either way)
        self.l2_prefetch = os.environ.get("TINYVLLM_L2_PREFETCH", "0") == "1"
        # ops (kernel names, or linear()'s "gemv NxK" / "cublas NxK") left out of every step:
        # benchmarks/decode_profile.py --leave-one-out measures each op's in-graph cost so
        self.skip_ops: frozenset[str] = frozenset()
        # the widest projection linear() sends to the GEMV (on_gemv); decode_profile.py
        # --compare-gemv lowers it to put the LM head back on cuBLAS
        self.gemv_max_n = GEMV_MAX_N
        # the GEMV's ring path (gemv.cu's header): weights through per-warp cp.async rings in
        # shared memory instead of registers, the same bits at the same k-split; the default since
        # it measured 45 us per step ahead on Llama-1B (docs/perf-notes.md, session 9).
        # TINYVLLM_GEMV_RING=0 keeps the weights in registers.
        self.gemv_ring = os.environ.get("TINYVLLM_GEMV_RING", "1") != "0"
        # the warps per SM that gemv_k_warps counts as one wave (decode_profile.py --compare-gemv)
        self.gemv_wave_warps = GEMV_WARPS_PER_SM
        # per-projection k-split warps the decode layer uses instead of gemv_k_warps' rule, e.g.
        # {"o": 16}: the o GEMV at half an SM per CTA, so its grid becomes resident beside the
        # decode attention's blocks under PDL (parse_k_warps_for; TINYVLLM_GEMV_K_WARPS="o=16").
        # Empty by default. A different k-split sums in a different order: other bits.
        self.gemv_k_warps_for = parse_k_warps_for(os.environ.get("TINYVLLM_GEMV_K_WARPS", ""))
        # the GEMV's .L2::256B load hint: None follows gemv_wide_l2's rule, True / False force it
        # (benchmarks/gemv_bench.py and decode_profile.py --compare-gemv compare them)
        self.gemv_l2_hint: bool | None = None
        # the decode attention's early K/V copies (module docstring); TINYVLLM_ATTN_EARLY_KV=0: off
        self.early_kv = os.environ.get("TINYVLLM_ATTN_EARLY_KV", "1") != "0"
        if self.fuse_norm not in ("auto", "all", "none", "producer"):
            raise ValueError(f"TINYVLLM_FUSE_NORM must be auto, all, none or producer, got {self.fuse_norm!r}")
        self.stream_handle = stream.handle if stream is not None else 0
        self._gemv_shapes: dict[tuple[int, int, int], tuple] = {}
        # observer(op, repeat, details): called before each op with a zero-argument callable
        # that enqueues the same op again; None (the default) costs one attribute test per op
        self.observer = None
        self._in_linear = False

    def _launch(self, kernel: str, grid, block, *args, shared_bytes: int = 0) -> None:
        fn, grid, block = self.library.function(kernel), _dim3(grid), _dim3(block)
        if shared_bytes > fn.max_dynamic_shared_bytes:
            # once per kernel and size, outside any capture (each graph's launches run eagerly first)
            fn.set_max_dynamic_shared_bytes(shared_bytes)
        launch = lambda: fn.launch(grid, block, self.stream_handle, args, shared_bytes, self.pdl)  # noqa: E731
        if self.skip_ops and not self._in_linear and kernel in self.skip_ops:
            return
        if self.observer is not None and not self._in_linear:
            self.observer(kernel, launch, {"grid": grid, "block": block, "args": args, "shared_bytes": shared_bytes})
        launch()

    # -- one launcher per kernel, in the order the model calls them ------------------------------
    def embedding(self, out, table, token_ids, num_tokens: int, hidden: int, vocab_size: int,
                  fed_rows=0, fed_ids=0, norm=None, head_argmax=0) -> None:
        """out[t] = table[id_t] (bf16 rows; an id outside the vocab gives a zero row), id_t =
        fed_ids[fed_rows[t]] where fed_rows (int32 [num_tokens], 0: none) is >= 0, else
        token_ids[t]. norm = (norm_weight, normed, row_ss): the first layer's input norm handed
        over as gemv_residual_norm() hands the others over (embedding.cu's header): normed [T,
        hidden] = bf16(out * norm_weight), row_ss (fp32 [T, hidden / 16]) the rows' sums of
        squares of 16 columns each, for gemv_rope_kv(prenormed=(row_ss, eps)). head_argmax (uint64
        [num_tokens], 0: none): cleared to 0 for the LM head's argmax keys (gemv(head_argmax=))."""
        norm_w, normed, row_ss = norm or (0, 0, 0)
        if norm is not None and (hidden % 16 or not (int(norm_w) and int(normed) and int(row_ss))):
            raise ValueError(f"embedding: the handed-over norm needs hidden % 16 == 0 (got {hidden}) and its "
                             f"weight, normed and row_ss pointers")
        self._launch("embedding_gather", num_tokens, EMBEDDING["THREADS"], out, table, token_ids,
                     fed_rows, fed_ids, num_tokens, hidden, vocab_size, norm_w, normed, row_ss, head_argmax)

    def rms_norm(self, out, x, weight, num_rows: int, hidden: int, eps: float, rows=0) -> None:
        """out[r] = RMSNorm(x[rows[r] if rows else r]) * weight; one block per output row."""
        if hidden > RMS_NORM["MAX_HIDDEN"]:
            raise ValueError(f"rms_norm: hidden {hidden} is above the kernel's MAX_HIDDEN {RMS_NORM['MAX_HIDDEN']}")
        self._launch("rms_norm", num_rows, RMS_NORM["THREADS"], out, x, weight, rows, num_rows, hidden, eps)

    def rope_write_kv(self, qkv, k_cache, v_cache, positions, slot_mapping, inv_freq, num_tokens: int,
                      num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Rotate q and k in the fused qkv rows; write k and v to the paged cache at slot_mapping."""
        self._launch("rope_write_kv", num_tokens, ROPE["THREADS"], qkv, k_cache, v_cache, positions,
                     slot_mapping, inv_freq, num_tokens, num_q_heads, num_kv_heads, head_dim)

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
                         block_size: int, scale: float, splits: int | None = None,
                         l2_prefetch: tuple | None = None, early_kv: bool | None = None) -> None:
        """One query token per sequence over its paged context, split over the context; the last
        split to finish merges. Grid: (sequences x kv heads, 1, splits); one block per GQA group,
        SMEM_BYTES_PER_DIM x head_dim bytes of dynamic shared memory (its cp.async rings).
        l2_prefetch = (device pointer, bytes), both multiples of 16: the grid also gets
        ceil(PREFETCH_CTAS / splits) columns along x of blocks that prefetch that range into L2
        (model.py: the next projections' weights) without waiting for the previous kernel, and
        leave; a hint that changes timing only, never a bit. None or 0 bytes: no such blocks.
        early_kv (None: self.early_kv, on unless TINYVLLM_ATTN_EARLY_KV=0): issue the K/V copies of every row
        but each sequence's newest (position context - 1) before waiting for the previous kernel;
        only for decode, where that row is the only one a still-running kernel writes. The same
        bits either way."""
        splits = splits or self.decode_splits(num_seqs, num_kv_heads)
        if not 1 <= splits <= MAX_DECODE_SPLITS:
            raise ValueError(f"attention_decode: splits must be in 1..{MAX_DECODE_SPLITS}, got {splits}")
        ptr, nbytes = self._prefetch_range(l2_prefetch)
        columns = math.ceil(DECODE["PREFETCH_CTAS"] / splits) if nbytes else 0   # the kernel's prefetch_columns()
        self._launch(f"attention_decode_d{head_dim}_g{num_q_heads // num_kv_heads}",
                     (num_seqs * num_kv_heads + columns, 1, splits), DECODE["THREADS"], out, partial_out,
                     partial_ml, split_counters, q, q_row_stride, k_cache, v_cache, block_tables,
                     block_table_width, context_lens, block_size, num_kv_heads, scale, ptr, nbytes,
                     int(self.early_kv if early_kv is None else early_kv), shared_bytes=DECODE["SMEM_BYTES_PER_DIM"] * head_dim)

    @staticmethod
    def _prefetch_range(l2_prefetch) -> tuple[int, int]:
        """attention_decode's l2_prefetch checked: (pointer, bytes), (0, 0) for none."""
        if l2_prefetch is None:
            return 0, 0
        try:
            ptr, nbytes = (int(v) for v in l2_prefetch)
        except (TypeError, ValueError):
            raise ValueError(f"attention_decode: l2_prefetch must be (device pointer, bytes), got {l2_prefetch!r}") from None
        # cp.async.bulk.prefetch wants 16-byte aligned addresses and sizes (attention_decode.cu)
        if ptr < 0 or not 0 <= nbytes < 1 << 64 or (ptr | nbytes) & 15 or (nbytes and not ptr):
            raise ValueError(f"attention_decode: l2_prefetch needs a non-null 16-byte aligned pointer and a "
                             f"byte count >= 0 that is a multiple of 16, got ({ptr:#x}, {nbytes})")
        return ptr, nbytes

    def silu_mul(self, out, gate_up, num_tokens: int, inter: int) -> None:
        """out = silu(gate) * up over the fused gate_up rows; grid-stride, at most 4 waves."""
        threads = SILU["THREADS"]
        grid = min(num_tokens * inter // 8 // threads + 1, 4 * self.num_sms)
        self._launch("silu_mul", grid, threads, out, gate_up, num_tokens, inter)

    def sample_slices(self, num_seqs: int, vocab_size: int) -> int:
        """Blocks per row for the sampler's argmax pass (sampling.cu's header): a slice of
        ARGMAX_SLICE_VALUES logits each, at most MAX_ARGMAX_SLICES, and no more blocks in all
        than about two per SM (a big batch has blocks enough with one per row). Llama-3's
        128,256 logits at batch 1 -> 32; SmolLM2's 49,152 -> 12; batch >= 2 * num_sms -> 1.
        It depends on the batch size only, as the graphs need; the token is the same for any."""
        by_vocab = math.ceil(vocab_size / SAMPLING["ARGMAX_SLICE_VALUES"])
        return max(1, min(SAMPLING["MAX_ARGMAX_SLICES"], by_vocab, 2 * self.num_sms // max(num_seqs, 1)))

    def sample(self, logits, num_seqs: int, vocab_size: int, temperature, top_k, top_p, seeds, steps,
               out, min_p=0, argmax_partials=0, slice_counters=0, slices: int | None = None,
               head_argmax=0, out_host=0) -> None:
        """One token id per row of fp32 logits (reference/sampling.py defines the algorithm).
        Non-greedy rows' logits are overwritten with their sampling weights. min_p: a float32
        [num_seqs] device array, or 0 (null) for min_p off in every row. argmax_partials (int32
        [num_seqs, MAX_ARGMAX_SLICES, 4]) and slice_counters (int32 [num_seqs], zero, and left
        zero by the kernel) let the argmax pass run in `slices` blocks per row (None:
        sample_slices'); without them it runs in one. head_argmax (uint64 [num_seqs], 0: none):
        the argmax keys the decode LM head kept (gemv(head_argmax=)), which replace the argmax
        pass: one block per row, the same token (sampling.cu's header). out_host (0: none): a
        device pointer of mapped page-locked host memory that gets a copy of out, written by the
        kernel over PCIe (how a decode step's ids reach the host: cuda_runner.py)."""
        if not num_seqs:
            return
        if head_argmax:
            if slices not in (None, 1):
                raise ValueError(f"sample: the LM head's argmax keys leave no argmax pass to split ({slices} slices)")
            argmax_partials, slice_counters, slices = 0, 0, 1
        elif not (argmax_partials and slice_counters):
            if slices not in (None, 1):
                raise ValueError(f"sample: {slices} slices need argmax_partials and slice_counters")
            slices = 1
        slices = slices or self.sample_slices(num_seqs, vocab_size)
        if not 1 <= slices <= SAMPLING["MAX_ARGMAX_SLICES"]:
            raise ValueError(f"sample: slices must be in 1..{SAMPLING['MAX_ARGMAX_SLICES']}, got {slices}")
        self._launch("sample_tokens", (num_seqs, slices), SAMPLING["SAMPLE_THREADS"], logits, vocab_size,
                     temperature, top_k, top_p, min_p, seeds, steps, out, argmax_partials, slice_counters,
                     head_argmax, out_host)

    def apply_logit_edits(self, logits, vocab_size: int, edits, num_edits: int) -> None:
        """LogitEdits (engine/batch.py, uploaded as its packed() int32 [E, EDIT_WORDS]) applied
        in place to fp32 logits rows: one thread per entry. No entries: no launch."""
        if num_edits:
            self._launch("apply_logit_edits", math.ceil(num_edits / SAMPLING["EDIT_THREADS"]),
                         SAMPLING["EDIT_THREADS"], logits, vocab_size, edits, num_edits)

    def step_logprobs(self, logits, vocab_size: int, num_rows: int, sampled, k: int, sampled_logprob,
                      sampled_rank, top_ids, top_logprobs, rows=0) -> None:
        """Raw logprobs of num_rows rows of fp32 logits (reference/sampling.py's step_logprobs):
        output j reads logits row rows[j] (rows = 0: row j) and its sampled id sampled[that row];
        top_ids / top_logprobs are [num_rows, k]. One block per output row."""
        if not 0 <= k <= min(SAMPLING["MAX_TOP_LOGPROBS"], vocab_size):
            raise ValueError(f"step_logprobs: k must be in 0..{min(SAMPLING['MAX_TOP_LOGPROBS'], vocab_size)}, got {k}")
        if num_rows:
            self._launch("step_logprobs", num_rows, SAMPLING["SAMPLE_THREADS"], logits, vocab_size, rows,
                         sampled, k, sampled_logprob, sampled_rank, top_ids, top_logprobs)

    # -- projections -------------------------------------------------------------------------------
    def on_gemv(self, m: int, n: int, k: int) -> bool:
        """Whether linear() runs this shape on our GEMV (else cuBLAS)."""
        return self.use_gemv and n <= self.gemv_max_n and self.gemv_supports(m, n, k)

    def linear(self, y, x, w, m: int, n: int, k: int, *, accumulate: bool = False,
               out_dtype: str = "bfloat16", last: bool = False, k_warps: int | None = None) -> None:
        """Y[m, n] (+)= X[m, k] @ W[n, k]^T, row-major, W as HF stores it [out, in]; accumulate
        adds to Y (beta = 1: the fused residual add). The GEMV for small decode batches, else cuBLAS.
        last: the step's last projection (the LM head), launched by gemv_k_warps' rule for it;
        k_warps: the GEMV's k-split (None: that rule)."""
        on_gemv = self.on_gemv(m, n, k)
        if on_gemv:
            run = lambda: self.gemv(y, x, w, m, n, k, accumulate=accumulate, out_dtype=out_dtype, last=last,  # noqa: E731
                                    k_warps=k_warps)
        else:
            run = lambda: self.blas.matmul(y, x, w, m, n, k, accumulate=accumulate, out_dtype=out_dtype)  # noqa: E731
        name = f"{'gemv' if on_gemv else 'cublas'} {n}x{k}"
        if self.skip_ops and name in self.skip_ops:
            return
        if self.observer is not None:
            self.observer(name, self._quietly(run),
                          {"m": m, "n": n, "k": k, "accumulate": accumulate, "out_dtype": out_dtype,
                           "last": last, "y": y, "x": x, "w": w})
        self._quietly(run)()

    def fuses_decode(self, m: int, hidden: int, qkv_width: int, inter: int, head_dim: int) -> bool:
        """Whether a step of m tokens runs the fused decode layer: fusing is on and every
        projection of the layer runs on the GEMV (the fused kernels are GEMVs)."""
        return (self.fuse and head_dim % GEMV["ROWS_PER_CTA"] == 0 and inter % 8 == 0
                and all(self.on_gemv(m, n, k) for n, k in
                        ((qkv_width, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter))))

    def fuses_norm(self, n: int, k: int) -> bool:
        """Whether the fused decode layer runs the RMSNorm before an [n, k] GEMV inside it
        (gemv_norm_*: the scale comes out of the dot product, so the norm costs no launch and no
        extra round trip, but every CTA re-reads and scales all of x) instead of as a separate
        rms_norm launch. TINYVLLM_FUSE_NORM: "producer" (the default) hands every norm over to
        the kernel before it (model.py: gemv_residual_norm or the embedding, then prenormed), so
        this rule is not asked; it answers as "auto" would. "auto":
        inside where ceil(n / 16) * k <= NORM_INSIDE_MAX_VALUES (the measured rule), else
        separate; "all" or "none" (for A/B measurement; none gives the bits of TINYVLLM_FUSE=0)."""
        if self.fuse_norm in ("auto", "producer"):
            return math.ceil(n / GEMV["ROWS_PER_CTA"]) * k <= NORM_INSIDE_MAX_VALUES
        return self.fuse_norm == "all"

    def _quietly(self, run):
        """`run` with the observer told nothing of the kernels inside it (linear is one op)."""
        def quiet():
            self._in_linear = True
            try:
                run()
            finally:
                self._in_linear = False
        return quiet

    def decode_k_warps(self, projection: str, n: int, k: int) -> int:
        """The k-split of a decode layer's projection (DECODE_PROJECTIONS) with an [n, k] weight:
        gemv_k_warps_for's override, else gemv_k_warps' rule (o: beside_attention, it follows
        the attention)."""
        return self.gemv_k_warps_for.get(projection) or self.gemv_k_warps(n, k, beside_attention=projection == "o")

    @staticmethod
    def gemv_supports(m: int, n: int, k: int) -> bool:
        return 1 <= m <= GEMV_MAX_ROWS and n >= 1 and 8 <= k < GEMV_MAX_K and k % 8 == 0

    def gemv_k_warps(self, n: int, k: int, last: bool = False, beside_attention: bool = False) -> int:
        """Warps per CTA splitting K: double while the grid stays within one full wave
        (num_sms * 32 warps) and every warp keeps at least GEMV_MIN_STEPS_PER_WARP steps;
        beside_attention (the o GEMV): at most GEMV_BESIDE_ATTENTION_WARPS.
        Llama-3.2-1B on 132 SMs: qkv -> 16, o -> 16 (32 without the cap), down -> 32, gate_up -> 4; SmolLM2-135M:
        qkv, o, gate_up -> 8, down -> 16. More warps put more of a small matrix in flight at once:
        at SmolLM2's shapes 8-16 warps of ~2 steps beat 4 of ~4 by 0.6-1.0 us per call
        (benchmarks/gemv_bench.py --shapes 135m, H200, docs/perf-notes.md).
        last: the step's last projection (the LM head), whose tail nothing can overlap (the
        sampler needs every logit). Its grid may go past one wave while every warp keeps UNROLL
        steps: Llama-1B's head -> 16 warps, SmolLM2's -> 4. Alone, gemv_bench measures more
        warps faster for every big matrix (1B gate_up 17.5 us at 16 warps against 19.1 at 4), but
        inside the decode graph a per-layer GEMV past one wave made the step slower (1B +35 us
        with gate_up at 16): CTAs that start in later waves hold back the next kernel's launch
        under PDL (decode_profile.py --compare-gemv, session 8)."""
        ctas, steps = math.ceil(n / GEMV["ROWS_PER_CTA"]), math.ceil(k / GEMV["STEP_K"])
        kw, most = 1, GEMV_BESIDE_ATTENTION_WARPS if beside_attention else GEMV["MAX_K_WARPS"]
        while kw < most and steps >= kw * 2 * GEMV_MIN_STEPS_PER_WARP:
            one_wave = ctas * kw * 2 <= self.num_sms * self.gemv_wave_warps
            if not (one_wave or (last and steps >= kw * 2 * GEMV["UNROLL"])):
                break
            kw *= 2
        return kw

    def gemv_wide_l2(self, k: int, k_warps: int) -> bool:
        """Whether a GEMV's weight loads carry the .L2::256B hint (gemv.cu's header). The ring
        path: always (in the Llama-1B decode graph 0.823 ms against 0.830 with the register
        path's rule, two rounds each, session 9). The register path: when each warp walks at
        least GEMV_WIDE_L2_MIN_STEPS steps, so the 256 bytes a load asks L2 for are the ones its
        next steps read (gemv_bench alone, H200: Llama-1B gate_up, 4 warps of 16 steps, 19.05 ->
        17.62 us with it; qkv, o, down, 2-8 steps, 0.1-0.4 us slower). gemv_l2_hint overrides both."""
        if self.gemv_l2_hint is not None:
            return self.gemv_l2_hint
        if self.gemv_ring:
            return True
        return math.ceil(k / GEMV["STEP_K"]) >= GEMV_WIDE_L2_MIN_STEPS * k_warps

    def gemv_launch_shape(self, n: int, k: int, k_warps: int | None = None, last: bool = False) -> tuple:
        """(grid, block, shared_bytes) for an [n, k] weight: one CTA per ROWS_PER_CTA outputs,
        k_warps warps splitting K; cached, so a call costs a dict lookup."""
        kw = k_warps or self.gemv_k_warps(n, k, last)
        key = (n, k, kw, self.gemv_ring)
        shape = self._gemv_shapes.get(key)
        if shape is None:
            if not 1 <= kw <= GEMV["MAX_K_WARPS"]:
                raise ValueError(f"k_warps must be in 1..{GEMV['MAX_K_WARPS']}, got {kw}")
            rows = GEMV["ROWS_PER_CTA"]
            per_warp = 8 * rows * 4 + (GEMV["RING_BYTES_PER_WARP"] if self.gemv_ring else 0)
            shape = ((math.ceil(n / rows), 1, 1), (32 * kw, 1, 1), kw * per_warp)
            self._gemv_shapes[key] = shape
        return shape

    def _gemv_args(self, what: str, x, w, m: int, n: int, k: int, out_dtype: str, k_warps, *more,
                   last: bool = False):
        """Checks shared by the three GEMV launchers -> (grid, block, shared bytes, x, w, wide_l2)."""
        if not self.gemv_supports(m, n, k):
            raise ValueError(f"{what}: unsupported shape m={m}, n={n}, k={k} (needs 1 <= m <= {GEMV_MAX_ROWS}, "
                             f"n >= 1, k % 8 == 0, 8 <= k < {GEMV_MAX_K}); use cuBLAS")
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"{what}: out_dtype must be one of {sorted(OUT_DTYPES)}, got {out_dtype!r}")
        x_ptr, w_ptr = int(x), int(w)
        if (x_ptr | w_ptr) & 15 or any(int(p) & 15 for p in more):
            names = ", ".join(f"{p:#x}" for p in (x_ptr, w_ptr, *map(int, more)))
            raise ValueError(f"{what}: x, w (and the norm weight or its row sums) must be 16-byte aligned ({names})")
        grid, block, shared = self.gemv_launch_shape(n, k, k_warps, last)
        return grid, block, shared, x_ptr, w_ptr, int(self.gemv_wide_l2(k, block[0] // 32))

    def gemv(self, y, x, w, m: int, n: int, k: int, *, accumulate: bool = False,
             out_dtype: str = "bfloat16", k_warps: int | None = None, last: bool = False,
             prenormed=None, head_argmax=0) -> None:
        """linear()'s small-batch path: the same arguments and meaning as Cublas.matmul, for
        1 <= m <= 8 and k % 8 == 0 with x and w 16-byte aligned. Streams W once with 16-byte
        loads, maths on the tensor cores (gemv.cu's header has the layout). last: gemv_k_warps'.
        prenormed = (row_ss, eps): Y = inv_rms * (X @ W^T) with X and row_ss handed over by
        gemv_residual_norm() (gemv_prenormed_bf16: the decode LM head after the final norm; no
        accumulate, k % 64 == 0). head_argmax (uint64 [m], zeroed before: embedding()'s, 0: none),
        prenormed with fp32 Y only: each row's greedy argmax key (common.cuh), for sample()."""
        if head_argmax and (prenormed is None or out_dtype != "float32"):
            raise ValueError("gemv: head_argmax is kept by the prenormed GEMV with fp32 output (the decode LM head)")
        if prenormed is None:
            grid, block, shared, x_ptr, w_ptr, wide = self._gemv_args("gemv", x, w, m, n, k, out_dtype, k_warps,
                                                                      last=last)
            self._launch("gemv_bf16", grid, block, int(y), x_ptr, w_ptr, m, n, k, OUT_DTYPES[out_dtype],
                         int(accumulate), wide, int(self.gemv_ring), shared_bytes=shared)
            return
        if accumulate:
            raise ValueError("gemv: a prenormed GEMV stores its product; accumulate is not built")
        row_ss, eps = prenormed
        grid, block, shared, x_ptr, w_ptr, wide = self._gemv_args("gemv_prenormed_bf16", x, w, m, n, k, out_dtype,
                                                                  k_warps, row_ss, last=last)
        shared += self._producer_ss_bytes("gemv_prenormed_bf16", m, k)
        self._launch("gemv_prenormed_bf16", grid, block, int(y), x_ptr, int(row_ss), w_ptr, m, n, k, float(eps),
                     OUT_DTYPES[out_dtype], head_argmax, wide, int(self.gemv_ring), shared_bytes=shared)

    @staticmethod
    def _producer_ss_bytes(kernel: str, m: int, k: int) -> int:
        """The shared memory a prenormed GEMV adds: the producer's m x k / 16 row sums, copied in
        whole 16-byte chunks (so k % 64 == 0)."""
        if k % 64:
            raise ValueError(f"{kernel}: needs k % 64 == 0 (whole 16-byte chunks of row sums), got k = {k}")
        return m * (k // GEMV["ROWS_PER_CTA"]) * 4

    def gemv_residual_norm(self, y, x, w, m: int, n: int, k: int, norm_weight, normed, row_ss, *,
                           k_warps: int | None = None) -> None:
        """The handed-over norm's producer (gemv.cu's header): y += X @ W^T as gemv() with
        accumulate (the o or down projection adding into the residual stream y [m, n]), and for
        the RMSNorm after it normed [m, n] = bf16(y * norm_weight) and row_ss (fp32 [m,
        ceil(n / 16)]) = each CTA's sum of its 16 new y values' squares per row: what
        gemv_rope_kv / gemv_silu_mul take as prenormed=(row_ss, eps)."""
        grid, block, shared, x_ptr, w_ptr, wide = self._gemv_args("gemv_residual_norm", x, w, m, n, k, "bfloat16",
                                                                  k_warps, norm_weight, normed)
        self._launch("gemv_residual_norm_bf16", grid, block, int(y), x_ptr, w_ptr, m, n, k, int(norm_weight),
                     int(normed), int(row_ss), wide, int(self.gemv_ring), shared_bytes=shared)

    def gemv_rope_kv(self, qkv, x, w, m: int, n: int, k: int, k_cache, v_cache, positions, slot_mapping,
                     inv_freq, *, num_q_heads: int, num_kv_heads: int, head_dim: int, norm=None,
                     prenormed=None, k_warps: int | None = None) -> None:
        """The decode qkv projection with rope_write_kv inside: qkv = X @ W^T, then RoPE on q (in
        place) and k, and k, v into the paged cache at slot_mapping — the bits of gemv() then
        rope_write_kv(). norm = (norm_weight, eps): x is the residual stream [m, k] and its
        RMSNorm goes inside, scale out of the dot product: qkv = inv_rms * (bf16(x * norm_weight)
        @ W^T) before the epilogue (reference/kernels.py: rms_norm_linear) — close to, not the
        bits of, rms_norm() then the rest. prenormed = (row_ss, eps): x is gemv_residual_norm()'s
        normed output and row_ss its sums of squares; the same formula, the scale from them
        (k % 64 == 0)."""
        if n != (num_q_heads + 2 * num_kv_heads) * head_dim or head_dim % GEMV["ROWS_PER_CTA"]:
            raise ValueError(f"gemv_rope_kv: n = {n} must be (q heads + 2 kv heads) * head_dim with "
                             f"head_dim % {GEMV['ROWS_PER_CTA']} == 0 (heads {num_q_heads}/{num_kv_heads}, "
                             f"head_dim {head_dim})")
        rope = (k_cache, v_cache, positions, slot_mapping, inv_freq, num_q_heads, num_kv_heads, head_dim)
        self._fused_gemv("rope_kv", qkv, x, w, m, n, k, norm, prenormed, k_warps, rope)

    def gemv_silu_mul(self, act, x, w, m: int, n: int, k: int, *, norm=None, prenormed=None,
                      k_warps: int | None = None) -> None:
        """The decode gate_up projection with silu_mul inside: act [m, n/2] = silu(gate) * up of
        X @ W^T, W = gate_up [n, k] (gate rows first) — the bits of gemv() then silu_mul().
        norm and prenormed as gemv_rope_kv()."""
        if n % 16:
            raise ValueError(f"gemv_silu_mul: n = 2 * intermediate = {n} must be a multiple of 16")
        self._fused_gemv("silu_mul", act, x, w, m, n, k, norm, prenormed, k_warps, ())

    _FUSED_GEMVS = {("rope_kv", None): "gemv_rope_kv_bf16", ("rope_kv", "norm"): "gemv_norm_rope_kv_bf16",
                    ("rope_kv", "prenormed"): "gemv_prenormed_rope_kv_bf16",
                    ("silu_mul", None): "gemv_silu_mul_bf16", ("silu_mul", "norm"): "gemv_norm_silu_mul_bf16",
                    ("silu_mul", "prenormed"): "gemv_prenormed_silu_mul_bf16"}

    def _fused_gemv(self, epilogue: str, y, x, w, m, n, k, norm, prenormed, k_warps, extra) -> None:
        if norm is not None and prenormed is not None:
            raise ValueError(f"gemv_{epilogue}: norm (inside) and prenormed (handed over) exclude each other")
        kind = "norm" if norm is not None else "prenormed" if prenormed is not None else None
        kernel = self._FUSED_GEMVS[epilogue, kind]
        # with a norm the kernel takes (..., x, norm_w or row_ss, w, m, n, k, eps, ...)
        norm_ptr, eps = norm or prenormed or (None, None)
        grid, block, shared, x_ptr, w_ptr, wide = self._gemv_args(kernel, x, w, m, n, k, "bfloat16", k_warps,
                                                                  *([norm_ptr] if kind else []))
        if kind is None:
            self._launch(kernel, grid, block, int(y), x_ptr, w_ptr, m, n, k, *extra, wide, int(self.gemv_ring),
                         shared_bytes=shared)
            return
        if kind == "norm":       # each warp's row sums of squares in shared memory
            shared += block[0] // 32 * GEMV["NORM_SS_BYTES_PER_WARP"]
        else:                    # the producer's row sums
            shared += self._producer_ss_bytes(kernel, m, k)
        self._launch(kernel, grid, block, int(y), x_ptr, int(norm_ptr), w_ptr, m, n, k, float(eps),
                     *extra, wide, int(self.gemv_ring), shared_bytes=shared)
