"""The launchers of the sampler's kernels (sampling.cu): sample_tokens, apply_logit_edits and
step_logprobs; and of token_mask.cu's apply_token_mask, which runs before them on a step with
structured outputs."""
from __future__ import annotations

import math

from tinyvllm.gpu.kernels import kernel_constants
from tinyvllm.gpu.ops.launch import OpsBase

SAMPLING = kernel_constants("sampling.cu")
MAX_ARGMAX_SLICES = SAMPLING["MAX_ARGMAX_SLICES"]   # the sampler's argmax blocks per row; sizes its workspace
TOKEN_MASK = kernel_constants("token_mask.cu")


class SamplingOps(OpsBase):
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
        kernel over PCIe (how a decode step's ids reach the host: gpu/input_banks.py)."""
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

    def apply_token_mask(self, logits, vocab_size: int, rows, bits, words_per_row: int, num_rows: int) -> None:
        """In place on fp32 logits [*, vocab_size]: row rows[j] (int32 [num_rows]) gets -inf at
        every token whose bit in bits[j] (uint32 [num_rows, words_per_row]) is 0 (structured
        outputs; reference/sampling.py's apply_token_mask). No rows: no launch."""
        if words_per_row * 32 < vocab_size:
            raise ValueError(f"apply_token_mask: {words_per_row} words of bits cannot cover {vocab_size} tokens")
        if num_rows:
            threads = TOKEN_MASK["MASK_THREADS"]
            self._launch("apply_token_mask", (math.ceil(vocab_size / threads), num_rows), threads,
                         logits, vocab_size, rows, bits, words_per_row, num_rows)
