"""Async scheduling (EngineConfig.async_scheduling; on by default where the runner overlaps steps,
i.e. on cuda): a decode step is launched before the step before it has been read back, so that
the host's work of a step (scheduling, building the inputs, reading the tokens back, the stop
conditions, the outputs) runs while the GPU computes the next.

Every input of decode step N+1 but its token ids follows from lengths alone; the ids are row r of
step N's sampled ids, which the device reads where N's sampler left them (ForwardBatch.fed_rows).
LLMEngine.step() still returns one step's outputs per call, the same as without it:

    step() call k:   [launch N+1 ahead]  [wait for N, apply its tokens, report N]
    step() call k+1: [launch N+2 ahead]  [wait for N+1 ...]          (N+1 is ready or nearly)

A step goes ahead only where nothing about it depends on N's tokens beyond the ids: after a
decode step, or a prefill-kind step (prompts, or prompts beside decode rows) of every running
sequence that ends each prompt in it (its sampled ids are then one per row too, so the first
decode step runs while the host reads the first token back), a batch whose rows all sample
plainly (no penalties, logit_bias, min_tokens ban, min_p or logprobs: batch.samples_ahead),
nobody waiting to be admitted, and a free block for every row that needs one.

A structured-output row goes ahead too, but its mask cannot: the mask of N+1 follows from the
matcher advanced with N's token. So N+1's SamplingBatch.token_mask is a PendingTokenMask
(structured/mask.py) and the runner starts N+1's forward alone; once N is applied (its tokens
appended, the matchers advanced), step_applied() resolves the mask — the host's mask work runs
while the GPU computes N+1's forward — and the runner then uploads it and launches the mask
and the sampler behind the forward. A row that N finishes is left out of the mask (its token is
thrown away, as below).

Only decode steps go ahead; a step with prompt work (a mixed step: the scheduler's decode rows
beside prompt chunks) is scheduled once N is applied. Its prompt rows are admission decisions —
the free blocks, preemption, which rows N finishes — that need N's tokens applied first, and a
step with prompt tokens is long enough that the host's work it would hide is a small part of it.
So a scheduled step's token ids are all on the host, and only decode steps carry fed rows. A row
that N ends by length (max_tokens, the context limit) is left out of N+1; a row that N ends by a
stop token or string, or that is aborted meanwhile, is computed and its token thrown away (its
K/V write lands in its own last block, which nothing else reads before it is handed out again —
and any later user's own writes come after it on the stream).
"""
from __future__ import annotations

import numpy as np

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch, samples_ahead
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.logit_edits import PLAIN
from tinyvllm.engine.model_runner import ModelRunner, PendingStep
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.scheduler import ScheduledBatch, Scheduler
from tinyvllm.engine.sequence import Request
from tinyvllm.structured.mask import PendingTokenMask


class StepAhead:
    """The decode step launched ahead of the one being read back, if any, and its counters."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, block_manager: BlockManager,
                 output_processor: OutputProcessor, requests: dict[str, Request]):
        self.runner, self.scheduler, self.block_manager = runner, scheduler, block_manager
        self.output_processor = output_processor
        self.requests = requests                  # the engine's unfinished requests, by id
        self.launched: tuple[ScheduledBatch, PendingStep] | None = None
        self.launched_mask: PendingTokenMask | None = None   # its constrained rows' mask, to come
        self.num_launched = 0                     # decode steps launched ahead ...
        self.num_rows_thrown_away = 0             # ... and their rows whose sequence finished meanwhile

    def launch_after(self, batch: ScheduledBatch, rows: np.ndarray | None) -> None:
        """Launch the decode step after `batch` (a decode step or a prefill, launched, not read
        back yet), where it can go ahead; where it cannot, it is scheduled as usual once `batch`
        is applied. rows: the row of each of batch's sequences in its launched step (None: its
        own order)."""
        self.launched_mask = None
        self.launched = self._launch(batch, rows)

    def _launch(self, batch: ScheduledBatch, rows: np.ndarray | None) -> tuple[ScheduledBatch, PendingStep] | None:
        if self.scheduler.waiting:
            # admitting them comes first, in a step scheduled after this one is applied (a mixed
            # step; a prompt chunk stays waiting too): module docstring
            return None
        if batch.is_prefill and (len(batch.seqs) != len(self.scheduler.running) or any(
                (r := self.requests.get(s.request_id)) is not None and r.held for s in batch.seqs)):
            return None      # rows that sat this prefill out, or samples it releases: the next step is theirs
        if any(s.sampler_state is not PLAIN for s in batch.seqs) and not all(samples_ahead(s) for s in batch.seqs):
            return None                  # its next sampler inputs depend on this step's token
        if not self.runner.takes_pending_token_masks and any(s.constraint is not None for s in batch.seqs):
            return None                  # the mask would have to be made before the launch
        seqs = [s for s in batch.seqs if not self.output_processor.ends_by_length(s, len(s.token_ids) + 1)]
        if not seqs:
            return None
        bm, block_size = self.block_manager, self.block_manager.block_size
        needing = sum(len(s.token_ids) + 1 > len(s.block_table) * block_size for s in seqs)
        if needing > bm.num_free_blocks:
            return None                  # the scheduler's preemption decides, next step
        for seq in seqs:
            bm.try_append_slot(seq, len(seq.token_ids) + 1)
        row_of = {id(s): i if rows is None else int(rows[i]) for i, s in enumerate(batch.seqs)}
        context_lens = [len(s.token_ids) + 1 for s in seqs]
        width = -(-max(context_lens) // block_size)
        forward = ForwardBatch.build_decode([0] * len(seqs), context_lens,
                                            bm.tables[[s.block_table_row for s in seqs], :width], block_size)
        forward.fed_rows = np.asarray([row_of[id(s)] for s in seqs], np.int32)
        sampling = SamplingBatch.from_sequences(seqs, tokens_ahead=1)
        pending = self.runner.launch(forward, sampling)
        self.launched_mask = sampling.token_mask
        self.num_launched += 1
        return ScheduledBatch(seqs, False, bm), pending

    def take(self) -> tuple[ScheduledBatch | None, PendingStep | None, np.ndarray | None]:
        """The step launched ahead, as this step's batch of the rows still running (a row
        finished or aborted since has its token thrown away) -> (batch, pending step, the rows of
        its sampled ids to keep); (None, None, None) when none was launched or no row is still
        running, and the step is scheduled as usual."""
        if self.launched is None:
            return None, None, None
        (batch, pending), self.launched, self.launched_mask = self.launched, None, None
        rows = [i for i, s in enumerate(batch.seqs) if not s.status.is_finished]
        self.num_rows_thrown_away += len(batch.seqs) - len(rows)
        if not rows:
            return None, None, None
        seqs = [batch.seqs[i] for i in rows]
        for seq in seqs:
            seq.num_scheduled_tokens = 1
        return ScheduledBatch(seqs, False, batch.block_manager), pending, np.asarray(rows, np.intp)

    def step_applied(self) -> None:
        """The step before the one launched ahead has been applied: forget the step launched
        ahead when every row of it has just finished (nothing of it is kept); else resolve its
        pending token mask now, the matchers holding their last token (the module docstring)."""
        if self.launched is not None and all(s.status.is_finished for s in self.launched[0].seqs):
            self.take()
        elif self.launched_mask is not None:
            self.launched_mask.resolve()
