"""Scheduler: which sequences run in the next step (what their new tokens do to them — text,
stop conditions, logprobs — is engine/output_processor.py's).

Each step fills a token budget (max_num_batched_tokens) and a sequence budget (max_num_seqs),
as vLLM V1 does:
  decode rows  first, one token for every running sequence, oldest first. When a sequence needs
            a block and none is free, a sequence is preempted: a partly prefilled one first
            (the most recently admitted), else the most recently admitted running one. Its
            blocks are freed and it goes back to the FRONT of the waiting queue, to be
            recomputed (prompt + generated tokens) from its blocks that the prefix cache still
            holds (block_manager.py). Sampling is counter based (see sampling.py), so a
            preempted request still produces exactly the same tokens. A step that preempted
            admits nothing: the blocks it freed are for the running sequences.
  prefill   then the budget left goes to the waiting sequences in arrival order (one that is
            partly prefilled first, being at the head), while the free KV blocks and
            max_num_seqs allow. A sequence whose prompt starts with cached blocks computes only
            the rest; one whose next blocks an earlier sequence of the step is computing waits
            for the next step, when they are cached (a prefix shared by a burst of requests is
            computed once). A prompt longer than what is left of the budget is prefilled in
            chunks, one per step, the rest of the step's rows beside it; a chunk that does not
            end its prompt samples nothing.
A step of decode rows only is a decode batch (the CUDA decode graphs run it); one with prefill
rows is a prefill-kind batch (is_prefill), its decode rows being queries of one token that read
their context through the block table like any cached prefix. When the decode rows alone fill
the budget (max_num_batched_tokens < max_num_seqs), the step is decode only.
Static scheduling (the comparison mode) admits a batch only when nothing is running, so each
batch runs to completion before the next starts; its steps are prefill or decode, never both,
and a prompt longer than the budget is chunked alone.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from tinyvllm.config import EngineConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool
    block_manager: BlockManager          # holds the block tables as rows of one matrix

    def forward_batch(self, block_size: int) -> ForwardBatch:
        """The model's input: each sequence's scheduled tokens, after its cached ones (a decode
        row's one token in a prefill-kind batch too: its num_cached_tokens is all but its last)."""
        seqs = self.seqs
        if not self.is_prefill:          # the hot path: every step of a long generation
            context_lens = [len(s.token_ids) for s in seqs]
            width = -(-max(context_lens) // block_size)     # = the longest block table
            tables = self.block_manager.tables[[s.block_table_row for s in seqs], :width]
            return ForwardBatch.build_decode([s.token_ids[-1] for s in seqs], context_lens,
                                             tables, block_size)
        new_tokens = [s.token_ids[s.num_cached_tokens:s.num_cached_tokens + s.num_scheduled_tokens]
                      for s in seqs]
        context_lens = [s.num_cached_tokens + s.num_scheduled_tokens for s in seqs]
        return ForwardBatch.build(new_tokens, context_lens, [s.block_table for s in seqs],
                                  block_size, self.is_prefill)

    def sampling_batch(self, eos_token_ids=()) -> SamplingBatch:
        """The step's sampler inputs (engine/batch.py): the plain arrays, plus the sparse logit
        edits (penalties, logit_bias, min_tokens' bans of eos_token_ids and stop ids), min_p
        and logprob requests of the rows that use them."""
        return SamplingBatch.from_sequences(self.seqs, eos_token_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 output_processor: OutputProcessor):
        self.config = config
        self.block_manager = block_manager
        self.output_processor = output_processor     # what a new token does (text, stops, logprobs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # in admission order: oldest first
        self._finished_unreported: list[Sequence] = []   # aborted, or out of KV cache
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def report_finished(self, seq: Sequence) -> None:
        """A sequence finished outside the queues (a held sample aborted): report it next step."""
        self._finished_unreported.append(seq)

    def add_next(self, seqs: list[Sequence]) -> None:
        """Queue sequences ahead of every waiting one (the samples of an admitted request, whose
        prompt blocks are in the prefix cache right now)."""
        self.waiting.extendleft(reversed(seqs))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished_unreported)

    def abort(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED) -> None:
        """Stop a sequence now and free its blocks; the next postprocess reports it (with
        status FINISHED_ERROR when the engine failed it)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return
        self._finish(seq, status)

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        if self.config.scheduling == "static":
            return self._schedule_static()
        preemptions = self.num_preemptions
        decode = self._schedule_decode()
        budget = self.config.max_num_batched_tokens - len(decode)
        prefill = self._schedule_prefill(budget, chunk_alone=False) if self.num_preemptions == preemptions else []
        if not prefill:
            return ScheduledBatch(decode, False, self.block_manager) if decode else None
        return ScheduledBatch(decode + prefill, True, self.block_manager)

    def _schedule_static(self) -> ScheduledBatch | None:
        if not self.running:
            prefill = self._schedule_prefill(self.config.max_num_batched_tokens, chunk_alone=True)
            if prefill:
                return ScheduledBatch(prefill, True, self.block_manager)
        decode = self._schedule_decode()
        return ScheduledBatch(decode, False, self.block_manager) if decode else None

    def _schedule_prefill(self, budget: int, chunk_alone: bool) -> list[Sequence]:
        """Prompt work for up to `budget` tokens from the head of the waiting queue -> its
        sequences, num_scheduled_tokens set; those that end their prompt move to running.
        chunk_alone: a prompt longer than the budget left is chunked only as the step's one row."""
        chunks = self._prompt_chunks(budget, chunk_alone)
        for seq, tokens in chunks:
            seq.num_scheduled_tokens = tokens
        return [seq for seq, _ in chunks]

    def prompts_wait_for(self, in_flight: dict[Sequence, int], budget: int, admissible) -> bool:
        """Whether a step launched ahead of the one in flight (engine/step_ahead.py) must leave
        the waiting queue alone: a waiting sequence it could admit is one `admissible` refuses,
        or starts with blocks that the step in flight computes (in_flight: its rows and their
        scheduled tokens). That sequence is then scheduled once the step is applied, as
        without the step ahead. Changes nothing."""
        bm, computing = self.block_manager, set()
        for seq, tokens in in_flight.items():
            computing.update(bm.block_hashes_between(seq, seq.num_cached_tokens, seq.num_cached_tokens + tokens))
        room = min(budget, self.config.max_num_seqs - len(self.running))
        for seq in itertools.islice(self.waiting, max(room, 0)):     # those it could admit
            if not admissible(seq):
                return True
            if computing and (uncached := bm.uncached_block_hashes(seq, bm.cached_prefix(seq))) \
                    and uncached[0] in computing:
                return True
        return False

    def schedule_prompts_ahead(self, budget: int, in_flight: dict[Sequence, int]) -> list[tuple[Sequence, int]]:
        """The prompt chunks of a step launched ahead of the one in flight, by schedule()'s rule
        (prompts_wait_for said it may): a chunk goes on after the in-flight step's tokens.
        -> [(sequence, tokens)]; num_scheduled_tokens is left alone (the step in flight's until
        it is applied)."""
        return self._prompt_chunks(budget, False, in_flight)

    def unschedule_prompts(self, chunks: list[tuple[Sequence, int]], had_blocks: set[Sequence]) -> None:
        """Undo schedule_prompts_ahead (its step could not be built): sequences it admitted give
        their blocks back (and the prefix-cache counts their admission added) and return to the
        head of the waiting queue in their order."""
        for seq, _ in reversed(chunks):
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
            if seq not in had_blocks:
                self.block_manager.undo_allocate(seq)

    def _prompt_chunks(self, budget: int, chunk_alone: bool,
                       in_flight: dict[Sequence, int] | None = None) -> list[tuple[Sequence, int]]:
        """schedule()'s prompt rule (module docstring) -> [(sequence, tokens)]; the sequences are
        admitted (blocks allocated, moved to running when the chunk ends the prompt)."""
        chunks: list[tuple[Sequence, int]] = []
        computing: set[bytes] = set()        # hashes of the full blocks this step computes
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.cached_prefix(seq)          # its prefix-cache hit, if new
            uncached = self.block_manager.uncached_block_hashes(seq, cached)
            if uncached and uncached[0] in computing:
                break       # an earlier sequence computes its next blocks now: cached next step
            done = seq.num_cached_tokens + (in_flight or {}).get(seq, 0)
            remaining = seq.num_tokens - done - len(cached) * self.block_manager.block_size
            if (chunk_alone and remaining > budget and chunks) or not self.block_manager.can_allocate(seq, cached):
                break
            self.block_manager.allocate(seq, cached)               # starts it after the cached tokens
            computing.update(uncached)
            tokens = min(remaining, budget)
            budget -= tokens
            chunks.append((seq, tokens))
            if tokens < remaining:
                break                        # a chunk: the sequence stays at the queue's head
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return chunks

    def _schedule_decode(self) -> list[Sequence]:
        """A token for every running sequence, oldest first, preempting where blocks run out
        (module docstring) -> the sequences that decode (self.running)."""
        candidates, self.running = deque(self.running), []
        while candidates:
            seq = candidates.popleft()
            while not self.block_manager.try_append_slot(seq):
                partial = self._partly_prefilled()
                if partial is not None:
                    self._preempt(partial)                   # admitted after every running one
                elif candidates:
                    self._preempt(candidates.pop())          # the most recently admitted
                elif self.running:
                    self._preempt(seq)
                    break
                else:   # it holds the whole cache by itself: it can never grow further
                    self._finish(seq, SequenceStatus.FINISHED_LENGTH)
                    break
            else:
                seq.num_scheduled_tokens = 1
                self.running.append(seq)
        return list(self.running)

    def _partly_prefilled(self) -> Sequence | None:
        """The waiting sequence that holds blocks (a prompt being chunked), if any."""
        if self.waiting and self.waiting[0].block_table:      # where a chunked prompt stays
            return self.waiting[0]
        return next((s for s in self.waiting if s.block_table), None)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)          # also resets num_cached_tokens: recompute all
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq in self.waiting:               # a prompt being chunked: it keeps its place
            return
        self.waiting.appendleft(seq)

    # -- after the model ran ---------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch | None, token_ids) -> list[Sequence]:
        """Apply one step's sampled tokens. -> the sequences with something to report: a new
        token, a finish (also aborts and cache exhaustion since the previous step)."""
        updated, self._finished_unreported = self._finished_unreported, []
        if batch is None:
            return updated
        # one pass of plain Python per sequence: this runs for every sequence on every step
        append_token = self.output_processor.append_token
        for seq, token in zip(batch.seqs, np.asarray(token_ids).tolist()):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_cached_tokens < len(seq.token_ids) or seq.status.is_finished:
                continue                      # a prompt chunk (no token yet), or aborted
            append_token(seq, token)
            if seq.status.is_finished:
                self.running.remove(seq)
                self.block_manager.free(seq)
            updated.append(seq)
        if batch.is_prefill:                  # publish the prompt blocks just computed
            for seq in batch.seqs:
                self.block_manager.publish(seq)
        return updated

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.block_manager.free(seq)
        seq.num_scheduled_tokens = 0
        seq.finish(status)
        self._finished_unreported.append(seq)
