"""OutputProcessor: what a sampled token does to its sequence — the text, the stop conditions and
the logprobs — so that the scheduler only schedules.

For every token the scheduler hands it (the sequence's prompt is computed and a token came out):
  1. append it (and its logprobs entry, when the request asked for logprobs);
  2. before min_tokens generated tokens nothing stops it but max_tokens and the context (the
     sampler keeps EOS and stop_token_ids from being sampled until then; engine/logit_edits.py);
  3. a stop token id (stop_reason = the id) or an EOS token (unless ignore_eos; stop_reason
     None) finishes it with finish_reason "stop"; the token stays in token_ids but its text is
     left out, unless include_stop_str_in_output;
  4. stop strings: the text is detokenized as it grows, and the first stop string to occur
     ends it (stop_reason = that string); the text is cut before the stop string, or after it
     with include_stop_str_in_output; tokens after the cut stay in token_ids, as in vLLM;
  5. max_tokens, or the context limit: finish_reason "length".
A constrained sequence (structured outputs) advances its grammar with the token after 3.; a
grammar now complete finishes it with "stop" (the token is text), before 4. and 5.
Sequences without stop strings are not detokenized here at all: their text is made when first
read (Sequence.text_reported), which offline generation does once, at the end.
"""
from __future__ import annotations

import time

import numpy as np

from tinyvllm.engine.batch import StepLogprobs
from tinyvllm.engine.outputs import Logprob
from tinyvllm.engine.sequence import Sequence, SequenceStatus
from tinyvllm.reference.sampling import step_logprobs


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids, context_limit: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_limit = context_limit
        self._pieces: dict[int, str] = {}          # token id -> its decoded text (logprob entries)

    # -- tokens --------------------------------------------------------------------------------
    def append_token(self, seq: Sequence, token: int) -> None:
        """Append one sampled token and apply the stop conditions (the module docstring)."""
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        params = seq.params
        num_out = len(seq.token_ids) - seq.num_prompt_tokens
        may_stop = num_out > params.min_tokens or params.min_tokens == 0
        if may_stop and token in seq.stop_token_ids:
            seq.stop_reason = token
            return self._finish_text(seq, SequenceStatus.FINISHED_STOPPED, params.include_stop_str_in_output)
        if may_stop and token in self.eos_token_ids and not params.ignore_eos:
            return self._finish_text(seq, SequenceStatus.FINISHED_STOPPED, params.include_stop_str_in_output)
        if seq.constraint is not None and (ended := seq.constraint.advance(seq, token)) is not None:
            return self._finish_text(seq, ended, token_is_text=True)     # the grammar is complete
        if seq.detokenizes_every_step:        # else the text is made when read (sequence.py)
            piece = seq.detokenizer.add(token)
            if piece and self._cut_at_stop_string(seq, piece, may_stop):
                return seq.finish(SequenceStatus.FINISHED_STOPPED)
        if self.ends_by_length(seq, len(seq.token_ids)):
            self._finish_text(seq, SequenceStatus.FINISHED_LENGTH, token_is_text=True)

    def ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the sequence is finished by length (max_tokens or the context limit) once it
        holds num_tokens tokens."""
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.context_limit

    def _finish_text(self, seq: Sequence, status: SequenceStatus, token_is_text: bool) -> None:
        """Finish, first releasing text the detokenizer held back (an incomplete character)."""
        if not seq.detokenizes_every_step:
            seq.end_text(seq.num_output_tokens - (not token_is_text), flush=True)
            return seq.finish(status)
        if token_is_text and status is SequenceStatus.FINISHED_STOPPED:   # the stop token's own text
            piece = seq.detokenizer.add(seq.token_ids[-1])
            seq.text += piece
        tail = seq.detokenizer.flush()
        stopped = bool(tail) and self._cut_at_stop_string(seq, tail, True)
        seq.finish(SequenceStatus.FINISHED_STOPPED if stopped else status)

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, piece: str, may_stop: bool) -> bool:
        """Append `piece` to the text; if a stop string now occurs, cut the text at it."""
        stops = seq.stop_strings
        start = max(0, len(seq.text) - max((len(s) for s in stops), default=0) + 1)
        seq.text += piece
        if not may_stop:
            return False
        hits = [(i, s) for i, s in ((seq.text.find(s, start), s) for s in stops) if i >= 0]
        if not hits:
            return False
        at, stop = min(hits, key=lambda h: h[0])
        seq.text = seq.text[:at + len(stop)] if seq.params.include_stop_str_in_output else seq.text[:at]
        seq.stop_reason = stop
        return True

    # -- logprobs ------------------------------------------------------------------------------
    def append_step_logprobs(self, seqs: list[Sequence], tokens: np.ndarray, runner) -> None:
        """The logprobs of a step's sampled tokens (`tokens`, one per row of `seqs`), out of
        runner.last_logprobs, for the rows that asked; called before append_token appends the
        tokens. A prompt chunk that samples nothing is skipped by its row's count, and so is a row
        the sampler failed (id -1)."""
        rows = [i for i, s in enumerate(seqs) if s.logprobs is not None and tokens[i] >= 0
                and s.num_cached_tokens + s.num_scheduled_tokens >= len(s.token_ids)]
        if not rows:
            return
        sampled_ids = np.asarray(tokens)[rows]
        k = max(seqs[i].params.logprobs for i in rows)
        sampled, ranks, top_ids, top_lps = logprobs_of_rows(runner.last_logprobs, rows, k)
        for j, i in enumerate(rows):
            kk = seqs[i].params.logprobs
            self.append_logprobs(seqs[i], int(sampled_ids[j]), float(sampled[j]), int(ranks[j]),
                                 top_ids[j, :kk].tolist(), top_lps[j, :kk].tolist())

    def append_logprobs(self, seq: Sequence, token: int, sampled_logprob: float, rank: int,
                        top_ids, top_logprobs) -> None:
        """The entry of the token just sampled, in vLLM's shape: {token_id: Logprob}, the top
        k first (descending), then the sampled token if it is not among them."""
        entry = {int(t): Logprob(float(lp), r + 1, self.decoded(int(t)))
                 for r, (t, lp) in enumerate(zip(top_ids, top_logprobs))}
        if token not in entry:
            entry[token] = Logprob(float(sampled_logprob), int(rank), self.decoded(token))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += float(sampled_logprob)

    def prompt_logprobs(self, prompt_ids: list[int], logits: np.ndarray, k: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first prompt token (nothing predicts it), then
        for each later one its logprob (and the top k) under the logits of the position before.
        logits: float32 [len(prompt_ids), vocab], the logits at every prompt position."""
        following = np.asarray(prompt_ids[1:], np.int64)
        sampled, ranks, top_ids, top_lps = step_logprobs(logits[:-1], following, k)   # the step path's twin
        out: list[dict | None] = [None]
        for i, token in enumerate(following.tolist()):
            entry = {int(t): Logprob(float(lp), r + 1, self.decoded(int(t)))
                     for r, (t, lp) in enumerate(zip(top_ids[i].tolist(), top_lps[i].tolist()))}
            if token not in entry:
                entry[token] = Logprob(float(sampled[i]), int(ranks[i]), self.decoded(token))
            out.append(entry)
        return out

    def decoded(self, token: int) -> str:
        """A token's text on its own, as vLLM's Logprob.decoded_token."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return piece


def logprobs_of_rows(last: StepLogprobs | None, rows: list[int], k: int):
    """The logprobs of batch rows `rows`, out of a runner's last_logprobs (`last`, whose row j is
    batch row last.rows[j]) -> (sampled_logprob float32 [R], sampled_rank int32 [R], top_ids
    int32 [R, k], top_logprobs float32 [R, k]), top-k columns cut to k."""
    if last is None:
        raise RuntimeError("the last step computed no logprobs")
    where = {int(r): j for j, r in enumerate(last.rows)}
    missing = [r for r in rows if r not in where]
    if missing:
        raise RuntimeError(f"the sampler returned no logprobs for batch rows {missing}")
    pick = [where[r] for r in rows]
    return (last.sampled_logprob[pick], last.sampled_rank[pick], last.top_ids[pick, :k],
            last.top_logprobs[pick, :k])
