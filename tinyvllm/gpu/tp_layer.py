"""The forward of one tensor-parallel rank among N > 1 (parallel/sharding.py splits the weights;
each rank's LlamaModel holds its shards at its own sizes): LlamaModel's forward with the
collectives between the shards, enqueued on the step's stream so that the decode graphs capture
them with the kernels.

The residual adds. On one GPU the o and down projections add into the residual stream in their
GEMV / GEMM epilogue (beta = 1) and, on the fused decode layer, hand the next RMSNorm over from
there. Over N ranks each rank's product is a partial sum. Every rank stores its bare product in
`proj_out` (the buffer Gemma 3's sandwich norms already use), NCCL sums proj_out in place (bf16),
then one kernel adds it into the residual (tensor_parallel.cu's residual_add), handing the next
norm over on the fused layer; Gemma 3 takes the summed proj_out through its own
rms_norm_residual_add as on one GPU. Chosen over "rank 0 adds the residual in its epilogue, the
others store bare products, all-reduce the residual": every rank then launches the same kernels
with the same arguments (no rank-dependent branch in a captured graph), Llama and Gemma 3 share
one order (sum the product, then add it), and that order is the numpy twin's
(reference/model.py: hidden + all_reduce(x @ Wo^T)), so parallel/numpy_ranks.py stays the oracle.
The cost is one small row-wise kernel after each all-reduce, which on the fused layer also makes
the handed-over norm (a norm cannot be made inside a GEMV whose output is partial).

The embedding: each rank gathers the ids of its vocabulary slice (zero rows for the others:
embedding_gather_shard), NCCL sums the rows (exact: one non-zero term per row), then on the
fused layer residual_add with nothing to add hands the first layer's norm over.

The LM head: each rank computes its slice's logits into `shard_logits`; on the fused layer its
greedy argmax keys too (shifted to full-vocabulary ids, then all-reduced with max over uint64:
the row's argmax, lowest id among ties, as parallel/vocab_parallel.py's ids_from_keys has it).
Then every rank broadcasts its slice to the others (one grouped NCCL operation; slices may differ
by a row) and puts each slice into its columns of the arena's [rows, full vocab] `logits`
(place_vocab_slice: a kernel, so the step stays a chain of kernels under PDL), so
the sampler runs as on one GPU — temperature, top-k/p, logit edits, token masks and logprobs —
on every rank, with the same inputs and seeds giving the same ids; the engine reads rank 0's.
The gather is in every step (a captured decode graph serves greedy and sampled rows alike).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TensorParallelRank:
    """This rank's part in the group: its communicator, its vocabulary slice and every rank's
    (in rank order), and the LM head's buffers: shard_logits (fp32 [max seqs, own slice]) and the
    other ranks' slices received (parts[r]: fp32 [max seqs, rank r's slice]; parts[rank] is
    shard_logits). new() allocates them in one allocation, which close() frees. stream: the
    runner's (a pycuda Stream), the step's, on which every collective is enqueued."""
    communicator: object
    rank: int
    vocab_slices: list[range]
    full_vocab: int
    stream: object
    parts: list[int] = field(default_factory=list)
    allocation: object = None

    @classmethod
    def new(cls, communicator, rank: int, vocab_slices: list[range], max_seqs: int, stream) -> TensorParallelRank:
        import pycuda.driver as drv
        full = sum(len(v) for v in vocab_slices)
        allocation = drv.mem_alloc(max_seqs * full * 4)
        parts = [int(allocation) + max_seqs * v.start * 4 for v in vocab_slices]
        return cls(communicator, rank, list(vocab_slices), full, stream, parts, allocation)

    @property
    def vocab(self) -> range:
        return self.vocab_slices[self.rank]

    @property
    def shard_logits(self) -> int:
        return self.parts[self.rank]

    def sum(self, ptr, count: int) -> None:
        """The bf16 [count] at ptr summed over the ranks, in place, on the step's stream."""
        self.communicator.all_reduce(int(ptr), int(ptr), count, "bfloat16", self.stream.handle)

    def max_keys(self, keys, rows: int) -> None:
        """The uint64 argmax keys [rows] at keys, the max over the ranks, in place."""
        self.communicator.all_reduce(int(keys), int(keys), rows, "uint64", self.stream.handle, op="max")

    def broadcast_slices(self, rows: int) -> None:
        """Every rank's logits slice [rows, its size] into parts[r] on every rank: one broadcast
        rooted at each rank, as one grouped operation."""
        self.communicator.broadcast_each([(p, rows * len(v)) for p, v in zip(self.parts, self.vocab_slices)],
                                         "float32", self.stream.handle)

    def close(self) -> None:
        if self.allocation is not None:
            self.allocation.free()
            self.allocation = None


class TensorParallelLayers:
    """LlamaModel's forward over N > 1 ranks (module docstring); active where self.tp is set."""

    def _tp_forward(self, step, fused: bool, kw: dict[str, int]) -> None:
        c, w, ops, tp = self.cfg, self.w, self.ops, self.tp
        T, H, S = step.num_tokens, c.hidden_size, step.num_seqs
        tok = self.inputs[step.bank].tokens[step.is_prefill]
        ops.embedding_shard(self.hidden, w.embed, tok.token_ids, T, H, tp.vocab.start, len(tp.vocab),
                            fed_rows=tok.fed_rows, fed_ids=self.sampled_ids,
                            head_argmax=self.head_argmax if fused else 0, scale=self.embed_scale)
        tp.sum(self.hidden, T * H)
        if fused:   # the first layer's input norm handed over after the sum
            ops.residual_add(self.hidden, 0, T, H, c.norm_weight_offset,
                             hand_over=(w.layers[0].input_norm, self.normed, self.norm_row_ss))
        for layer, lw in enumerate(w.layers):
            if fused:
                self._decode_layer_fused(step, layer, lw, kw)
            else:
                self._layer(step, layer, lw, kw)
        if fused:   # the final norm handed over by the last residual_add; the keys made global, then maxed
            ops.gemv(tp.shard_logits, self.normed, w.lm_head, S, c.vocab_size, H, out_dtype="float32", last=True,
                     prenormed=(self.norm_row_ss, c.rms_norm_eps), head_argmax=self.head_argmax)
            if tp.vocab.start:
                ops.shift_argmax_keys(self.head_argmax, S, tp.vocab.start)
            tp.max_keys(self.head_argmax, S)
        else:
            ops.rms_norm(self.final_normed, self.hidden, w.final_norm, S, H, c.rms_norm_eps,
                         rows=self.inputs[step.bank].last_token_idx, weight_offset=c.norm_weight_offset)
            ops.linear(tp.shard_logits, self.final_normed, w.lm_head, S, c.vocab_size, H, out_dtype="float32",
                       last=True)
        tp.broadcast_slices(S)      # every slice to every rank, then each into its columns of [S, V]
        for part, v in zip(tp.parts, tp.vocab_slices):
            ops.place_vocab_slice(self.logits, part, S, len(v), v.start, tp.full_vocab)

    def _tp_residual(self, x, w: int, k: int, out_norm: int, T: int, k_warps: int, hand_over=None) -> None:
        """hidden += sum over ranks of x @ W^T (Gemma 3: + norm of that sum), every rank's product
        stored bare in proj_out and all-reduced first; hand_over: the next norm handed over."""
        c, H, ops = self.cfg, self.cfg.hidden_size, self.ops
        ops.linear(self.proj_out, x, w, T, H, k, k_warps=k_warps)
        self.tp.sum(self.proj_out, T * H)
        if c.sandwich_norms:
            ops.rms_norm_residual_add(self.hidden, self.proj_out, out_norm, T, H, c.rms_norm_eps,
                                      c.norm_weight_offset, hand_over=hand_over)
        else:
            ops.residual_add(self.hidden, self.proj_out, T, H, c.norm_weight_offset, hand_over=hand_over)
