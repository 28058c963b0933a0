"""The launchers of the kernels a tensor-parallel rank adds (tensor_parallel.cu): the embedding
gather of one vocabulary slice, the residual add after an all-reduce (handing the next norm over),
the LM head's argmax keys shifted to full-vocabulary ids, and a rank's logits put into their
columns of the full ones. gpu/tp_layer.py launches them."""
from __future__ import annotations

from tinyvllm.gpu.kernels import kernel_constants
from tinyvllm.gpu.ops.launch import OpsBase
from tinyvllm.gpu.ops.rowwise import RMS_NORM

TENSOR_PARALLEL = kernel_constants("tensor_parallel.cu")


class TensorParallelOps(OpsBase):
    def embedding_shard(self, out, table, token_ids, num_tokens: int, hidden: int, vocab_start: int, rows: int,
                        fed_rows=0, fed_ids=0, head_argmax=0, scale: float | None = None) -> None:
        """out[t] = table[id_t - vocab_start] * scale for ids in [vocab_start, vocab_start + rows),
        a zero row for every other id (embedding() for one rank's slice of the vocabulary: the
        all-reduce of out over the ranks is the whole lookup). fed_rows, fed_ids, head_argmax as
        embedding(); scale (Gemma 3: bf16(sqrt(hidden)); None: 1, the plain gather's bits)."""
        if hidden % 8:
            raise ValueError(f"embedding_shard: hidden {hidden} must be a multiple of 8")
        self._launch("embedding_gather_shard", num_tokens, TENSOR_PARALLEL["EMBED_THREADS"], out, table, token_ids,
                     fed_rows, fed_ids, num_tokens, hidden, int(vocab_start), int(rows), head_argmax,
                     1.0 if scale is None else float(scale))

    def residual_add(self, hidden, x, num_rows: int, hidden_size: int, weight_offset: float = 0.0,
                     hand_over=None) -> None:
        """hidden[r] = bf16(hidden[r] + x[r]) (x = 0: nothing added); hand_over = (next_weight,
        normed, row_ss): the norm after it handed over as rms_norm_residual_add(hand_over=) does
        (normed = bf16(hidden * (weight_offset + next_weight)), row_ss fp32 [num_rows,
        hidden_size / 16]). One block per row; hidden_size % 16 == 0."""
        if hidden_size % 16 or hidden_size > RMS_NORM["MAX_HIDDEN"]:
            raise ValueError(f"residual_add: hidden {hidden_size} must be a multiple of 16 and at most "
                             f"{RMS_NORM['MAX_HIDDEN']}")
        next_weight, normed, row_ss = hand_over or (0, 0, 0)
        self._launch("residual_add", num_rows, TENSOR_PARALLEL["ADD_THREADS"], hidden, x, num_rows, hidden_size,
                     float(weight_offset), next_weight, normed, row_ss)

    def shift_argmax_keys(self, keys, num_rows: int, vocab_start: int) -> None:
        """keys[r] -= vocab_start (uint64 [num_rows]): a rank's LM head argmax keys naming
        full-vocabulary ids (parallel/vocab_parallel.py's shard_argmax_keys)."""
        threads = TENSOR_PARALLEL["KEY_THREADS"]
        self._launch("shift_argmax_keys", -(-num_rows // threads), threads, keys, num_rows, int(vocab_start))

    def place_vocab_slice(self, logits, part, rows: int, slice_size: int, vocab_start: int, full_vocab: int) -> None:
        """logits[r, vocab_start:vocab_start + slice_size] = part[r] (fp32 [rows, slice_size]) for
        r < rows, logits fp32 [rows, full_vocab]: one rank's slice into the gathered logits."""
        if not (0 <= vocab_start and vocab_start + slice_size <= full_vocab and slice_size >= 1):
            raise ValueError(f"place_vocab_slice: slice [{vocab_start}, {vocab_start + slice_size}) is not inside "
                             f"a vocabulary of {full_vocab}")
        threads = TENSOR_PARALLEL["PLACE_THREADS"]
        columns = min(-(-slice_size // threads), 2 * self.num_sms)
        self._launch("place_vocab_slice", (columns, rows), threads, logits, part, rows, slice_size, int(vocab_start),
                     full_vocab)
