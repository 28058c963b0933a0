"""How a step's inputs reach the device and its token ids come back (part of CudaRunner).

Steps take the arena's two input banks in turn (StepShape.bank), and a step's inputs go up on a
copy stream of their own, by the copy engine: the upload of step N+1 runs while step N still
computes on the stream (it waits only for step N-1, the last to read that bank), and the stream
waits for it with an event that has long completed. The sampler itself writes the sampled ids
into the bank's page-locked buffer, which is mapped into the device's address space (a posted
PCIe write; sample_tokens' out_host). So between two decode graphs the stream holds nothing but
an event wait and the event the host waits on: the engine's step costs the graph + ~2 us,
against + ~8 us when a kernel uploaded the inputs and another brought the ids down between the
graphs (H100, 2026-12-06, d2471d9).

Two steps may be in flight: each has its own bank and its own ids buffer; the next one's inputs
are written into the page-locked mirror only after the last upload has read it (an event).
"""
from __future__ import annotations

import numpy as np
import pycuda.driver as drv

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.gpu.arena import INPUT_BANKS, TOKEN_INPUTS
from tinyvllm.gpu.step_shape import StepShape


class InputBanks:
    """CudaRunner's input banks: _init_input_banks() makes their streams, events and mapped ids
    buffers; _stage_inputs() writes a batch into the mirror and uploads it into the next bank."""

    def _init_input_banks(self) -> None:
        """Needs self.arena, self.dims, self.kv_cache and self.stream. The inputs' copy stream; the last
        upload's end (the mirror is free again, and the stream may run the step); per bank the
        point on the stream after which no step reads it, a page-locked buffer for its step's ids
        (mapped into the device) and the event of their arrival."""
        self._block_tables_offset = self.arena.layout.inputs["block_tables"].offset
        self._block_tables_flat = self.arena.host_inputs_bytes[self._block_tables_offset:].view(np.int32)
        self.upload_stream = drv.Stream()
        self._inputs_uploaded = drv.Event()
        self._inputs_uploaded.record(self.upload_stream)
        self._bank_free = [drv.Event() for _ in range(INPUT_BANKS)]
        for event in self._bank_free:
            event.record(self.stream)
        self._ids_host = [drv.pagelocked_empty(self.dims.seqs, np.int32, mem_flags=drv.host_alloc_flags.DEVICEMAP)
                          for _ in range(INPUT_BANKS)]
        self._ids_host_device_ptrs = [int(b.base.get_device_pointer()) for b in self._ids_host]
        self._ids_ready = [drv.Event() for _ in range(INPUT_BANKS)]
        self._next_bank = 0

    def _stage_inputs(self, batch: ForwardBatch, sampling: SamplingBatch | None, rows: int | None = None) -> StepShape:
        """Write the batch into the page-locked input mirror and upload it into the next input
        bank in one copy on the copy stream; the stream waits for it (module docstring).

        rows > num_seqs pads a decode batch up to a captured graph's size with harmless
        sequences: token 0 at position 0, no KV write (slot -1), context 1 through block 0,
        greedy; their outputs are never read."""
        T, S = batch.num_tokens, batch.num_seqs
        R = rows or S
        self._inputs_uploaded.synchronize()          # the last upload is done with the mirror
        if T > self.dims.tokens or R > self.dims.seqs:
            raise ValueError(f"batch of {T} tokens / {S} sequences exceeds the arena "
                             f"({self.dims.tokens} tokens / {self.dims.seqs} sequences)")
        width = batch.block_tables.shape[1]
        if width > self.dims.blocks_per_seq:
            raise ValueError(f"block table width {width} exceeds {self.dims.blocks_per_seq}")
        h = self.arena.host
        # per-token inputs: a decode step's own short arrays, or the prefill ones (arena.py)
        tok = {name: h(name if batch.is_prefill else f"decode_{name}") for name in TOKEN_INPUTS}
        tok["token_ids"][:T] = batch.token_ids
        tok["positions"][:T] = batch.positions
        tok["slot_mapping"][:T] = batch.slot_mapping
        h("query_start")[:S + 1] = batch.query_start
        h("context_lens")[:S] = batch.context_lens
        h("last_token_idx")[:S] = batch.last_token_indices
        if sampling is None:
            sampling = SamplingBatch.greedy(S)
        h("temperature")[:S] = sampling.temperature
        h("top_k")[:S] = sampling.top_k
        h("top_p")[:S] = sampling.top_p
        h("min_p")[:S] = sampling.min_p
        h("seeds")[:S] = sampling.seed
        h("steps")[:S] = sampling.step
        tok["fed_rows"][:T] = -1 if batch.fed_rows is None else batch.fed_rows
        if R > S:
            assert not batch.is_prefill and T == S, "only decode batches are padded"
            for name, value in (("token_ids", 0), ("fed_rows", -1), ("positions", 0), ("slot_mapping", -1)):
                tok[name][S:R] = value
            for name, value in (("context_lens", 1), ("temperature", 0.0), ("top_k", -1),
                                ("top_p", 1.0), ("min_p", 0.0), ("seeds", 0), ("steps", 0)):
                h(name)[S:R] = value
            h("last_token_idx")[S:R] = np.arange(S, R)
        h("cascade_prefix_len")[0] = self._cascade_prefix_len(batch)
        h("block_table_width")[0] = width
        # packed with this batch's width (the kernels read the width from the arena), so the
        # upload stops right after the rows in use
        self._block_tables_flat[:S * width] = batch.block_tables.reshape(-1)
        self._block_tables_flat[S * width:R * width] = 0
        end = self._token_inputs_end(T) if batch.is_prefill else self._block_tables_offset + R * width * 4
        bank, self._next_bank = self._next_bank, (self._next_bank + 1) % INPUT_BANKS
        # The stream so far ends with the previous step, the last one to read the bank before
        # this one: that bank's free point is here (this bank's was marked banks - 1 steps ago).
        self._bank_free[(bank - 1) % INPUT_BANKS].record(self.stream)
        self.upload_stream.wait_for_event(self._bank_free[bank])
        self.arena.upload_inputs(end, bank, self.upload_stream)
        self._inputs_uploaded.record(self.upload_stream)
        self.stream.wait_for_event(self._inputs_uploaded)
        return StepShape.of(batch, num_tokens=R if R > S else T, num_seqs=R, bank=bank)

    def _cascade_prefix_len(self, batch: ForwardBatch) -> int:
        """The positions of the batch's shared prefix (common_prefix_blocks whole blocks), which
        the cascade kernels read from the bank (gpu/model.py); 0 for none. The kernels take it
        as given, so a prefix that no decode batch can have is refused here: it must lie
        before every sequence's newest position (that row is written during the step)."""
        blocks = batch.common_prefix_blocks
        if not blocks:
            return 0
        prefix_len = blocks * self.kv_cache.block_size
        if batch.is_prefill or blocks > batch.block_tables.shape[1] or prefix_len >= int(batch.context_lens.min()):
            raise ValueError(f"common_prefix_blocks {blocks} is not a shared prefix of this batch: cascade "
                             "takes decode batches whose prefix lies before every sequence's newest position")
        return prefix_len

    def _token_inputs_end(self, num_tokens: int) -> int:
        """Where a prefill step's upload ends: past the first num_tokens of every prefill
        per-token array (they lie after the block tables, arena.py)."""
        inputs = self.arena.layout.inputs
        return max(inputs[name].offset + num_tokens * 4 for name in TOKEN_INPUTS)
