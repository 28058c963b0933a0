"""Async scheduling (EngineConfig.async_scheduling; on by default where the runner overlaps steps,
i.e. on cuda): a step is launched before the step before it has been read back, so that
the host's work of a step (scheduling, building the inputs, reading the tokens back, the stop
conditions, the outputs) runs while the GPU computes the next.

Every input of step N+1 but its decode rows' token ids follows from lengths (and prompts) alone;
those ids are row r of step N's sampled ids, which the device reads where N's sampler left them (ForwardBatch.fed_rows).
LLMEngine.step() still returns one step's outputs per call, the same as without it:

    step() call k:   [launch N+1 ahead]  [wait for N, apply its tokens, report N]
    step() call k+1: [launch N+2 ahead]  [wait for N+1 ...]          (N+1 is ready or nearly)

A step goes ahead where nothing about it depends on N's tokens beyond the ids: every sequence
running is one of N's rows, they all sample plainly (no penalties, logit_bias, min_tokens ban,
min_p or logprobs: batch.samples_ahead) and releases no held n > 1 samples, and there is a free
block for every row that needs one. Its decode rows are N's running rows (a prompt that N ends
decodes in N+1); prompt chunks of the waiting queue fill the rest of the token budget by the
scheduler's own rule (Scheduler.schedule_prompts_ahead: a chunked prompt goes on after N's
chunk), so a busy server's mixed steps go ahead like decode steps. The queue is left for the
step scheduled after N is applied where a sequence it could admit starts with blocks that N
computes (it will find them cached then) or samples other than plainly.

A structured-output row goes ahead too, but its mask cannot: the mask of N+1 follows from the
matcher advanced with N's token. So N+1's SamplingBatch.token_mask is a PendingTokenMask
(structured/mask.py) and the runner starts N+1's forward alone; once N is applied (its tokens
appended, the matchers advanced), step_applied() resolves the mask — the host's mask work runs
while the GPU computes N+1's forward — and the runner then uploads it and launches the mask
and the sampler behind the forward. A row that N finishes is left out of the mask (its token is
thrown away, as below).

What N+1 cannot know is which rows N finishes: rows that N ends by length (max_tokens, the
context limit) are left out of N+1, but its budget and blocks are given as if every other row
went on, and the blocks N's finished rows free come back for the step after. So a step ahead
can differ from the one scheduled after N is applied (a prompt chunk a step later, a shorter
chunk); every request's tokens are the same (sampling is counter based). A row that N ends
by a stop token or string, or that is aborted meanwhile, is computed and its token thrown away (its
K/V write lands in its own last block, which nothing else reads before it is handed out again —
and any later user's own writes come after it on the stream).
"""
from __future__ import annotations

import numpy as np

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch, samples_ahead
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.logit_edits import PLAIN, sampler_state
from tinyvllm.engine.model_runner import ModelRunner, PendingStep
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.scheduler import ScheduledBatch, Scheduler
from tinyvllm.engine.sequence import Request, Sequence, SequenceStatus
from tinyvllm.structured.mask import PendingTokenMask


class StepAhead:
    """The decode step launched ahead of the one being read back, if any, and its counters."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, block_manager: BlockManager,
                 output_processor: OutputProcessor, requests: dict[str, Request]):
        self.runner, self.scheduler, self.block_manager = runner, scheduler, block_manager
        self.output_processor = output_processor
        self.requests = requests                  # the engine's unfinished requests, by id
        self.launched: tuple[ScheduledBatch, PendingStep, list[int]] | None = None   # + tokens a row
        self.launched_mask: PendingTokenMask | None = None   # its constrained rows' mask, to come
        self.num_launched = 0                     # steps launched ahead ...
        self.num_rows_thrown_away = 0             # ... and their rows whose sequence finished meanwhile

    def launch_after(self, batch: ScheduledBatch, rows: np.ndarray | None) -> None:
        """Launch the step after `batch` (launched, not read back yet) where it can go ahead (the
        module docstring); where it cannot, it is scheduled as usual once `batch` is applied.
        rows: the row of each of batch's sequences in its launched step (None: its own order)."""
        self.launched_mask = None
        self.launched = self._launch(batch, rows)

    def _launch(self, batch: ScheduledBatch, rows: np.ndarray | None):
        """-> (the step's batch, its pending step, each row's scheduled tokens), or None."""
        scheduler = self.scheduler
        if scheduler.waiting and scheduler.config.scheduling == "static":
            return None       # static batches: the waiting batch starts once the running one ends
        decode = [s for s in batch.seqs if s.status is SequenceStatus.RUNNING]
        if len(decode) != len(scheduler.running) or any(
                (r := self.requests.get(s.request_id)) is not None and r.held for s in batch.seqs):
            return None      # rows that sat this step out, or samples it releases: the next step is theirs
        if not all(self._samples_ahead(s) for s in decode):
            return None                  # its next sampler inputs depend on this step's token
        decode = [s for s in decode if not self.output_processor.ends_by_length(s, len(s.token_ids) + 1)]
        bm, block_size = self.block_manager, self.block_manager.block_size
        grown = [s for s in decode if len(s.token_ids) + 1 > len(s.block_table) * block_size]   # need a block
        if len(grown) > bm.num_free_blocks:
            return None                  # the scheduler's preemption decides, next step
        # the step in flight's rows: the blocks they fill are being computed, and a prompt chunk
        # (its sequence still waiting, at the head) goes on after its tokens
        in_flight = {s: s.num_scheduled_tokens for s in batch.seqs}
        budget = scheduler.config.max_num_batched_tokens - len(decode)
        if scheduler.waiting and scheduler.prompts_wait_for(in_flight, budget, self._samples_ahead):
            return None
        if not decode and not scheduler.waiting:
            return None
        for seq in grown:
            bm.try_append_slot(seq, len(seq.token_ids) + 1)
        had_blocks = {s for s in scheduler.waiting if s.block_table}
        chunks = scheduler.schedule_prompts_ahead(budget, in_flight) if scheduler.waiting else []
        try:
            forward, sampling = self._inputs(decode, chunks, in_flight, batch, rows)
        except Exception:
            # a row that cannot be built: all of it undone, the step is scheduled once this one
            # is applied, where the engine fails that row's request alone (LLMEngine._batch_inputs)
            scheduler.unschedule_prompts(chunks, had_blocks)
            for seq in grown:
                bm.drop_last_block(seq)
            return None
        if forward is None:
            return None                  # no decode row, and no prompt chunk fitted
        pending = self.runner.launch(forward, sampling)
        self.launched_mask = sampling.token_mask
        self.num_launched += 1
        seqs = decode + [s for s, _ in chunks]
        return ScheduledBatch(seqs, bool(chunks), bm), pending, [1] * len(decode) + [n for _, n in chunks]

    def _inputs(self, decode: list[Sequence], chunks: list[tuple[Sequence, int]], in_flight: dict[Sequence, int],
                batch: ScheduledBatch, rows: np.ndarray | None) -> tuple[ForwardBatch | None, SamplingBatch | None]:
        """The launched-ahead step's inputs: the decode rows first (their ids fed from the step
        in flight's sampled rows), then the prompt chunks (a mixed step); (None, None) for none."""
        if not decode and not chunks:
            return None, None
        block_size = self.block_manager.block_size
        row_of = {id(s): i if rows is None else int(rows[i]) for i, s in enumerate(batch.seqs)}
        fed = np.asarray([row_of[id(s)] for s in decode], np.int32)
        context_lens = [len(s.token_ids) + 1 for s in decode]
        if chunks:
            starts = [s.num_cached_tokens + in_flight.get(s, 0) for s, _ in chunks]
            forward = ForwardBatch.build(
                [[0]] * len(decode) + [s.token_ids[a:a + n] for (s, n), a in zip(chunks, starts)],
                context_lens + [a + n for (_, n), a in zip(chunks, starts)],
                [s.block_table for s in decode] + [s.block_table for s, _ in chunks], block_size, True)
            forward.fed_rows = np.concatenate([fed, np.full(forward.num_tokens - len(decode), -1, np.int32)])
        else:
            width = -(-max(context_lens) // block_size)
            forward = ForwardBatch.build_decode([0] * len(decode), context_lens,
                                                self.block_manager.tables[[s.block_table_row for s in decode], :width],
                                                block_size)
            forward.fed_rows = fed
        ahead = np.asarray([1] * len(decode) + [0] * len(chunks), np.int32)
        return forward, SamplingBatch.from_sequences(decode + [s for s, _ in chunks], tokens_ahead=ahead)

    def _samples_ahead(self, seq: Sequence) -> bool:
        """Whether the row can be in a step launched ahead: its sampler inputs are known without
        the step before's token, and its mask, if any, can wait for the forward."""
        if sampler_state(seq, self.output_processor.eos_token_ids) is not PLAIN and not samples_ahead(seq):
            return False
        return seq.constraint is None or self.runner.takes_pending_token_masks

    def take(self) -> tuple[ScheduledBatch | None, PendingStep | None, np.ndarray | None]:
        """The step launched ahead, as this step's batch of the rows still running (a row
        finished or aborted since has its token thrown away) -> (batch, pending step, the rows of
        its sampled ids to keep); (None, None, None) when none was launched or no row is still
        running, and the step is scheduled as usual."""
        if self.launched is None:
            return None, None, None
        (batch, pending, scheduled), self.launched, self.launched_mask = self.launched, None, None
        rows = [i for i, s in enumerate(batch.seqs) if not s.status.is_finished]
        self.num_rows_thrown_away += len(batch.seqs) - len(rows)
        if not rows:
            return None, None, None
        seqs = [batch.seqs[i] for i in rows]
        for i in rows:
            batch.seqs[i].num_scheduled_tokens = scheduled[i]
        return ScheduledBatch(seqs, batch.is_prefill, batch.block_manager), pending, np.asarray(rows, np.intp)

    def step_applied(self) -> None:
        """The step before the one launched ahead has been applied: forget the step launched
        ahead when every row of it has just finished (nothing of it is kept); else resolve its
        pending token mask now, the matchers holding their last token (the module docstring)."""
        if self.launched is not None and all(s.status.is_finished for s in self.launched[0].seqs):
            self.take()
        elif self.launched_mask is not None:
            self.launched_mask.resolve()
