"""Request and Sequence: a request (one prompt, one SamplingParams) has n sequences, one per
sample (SamplingParams.n); a Sequence is everything the engine knows about one sample, and what
the scheduler schedules. What the engine reports after a step is engine/outputs.py's
RequestOutput, one per request."""
from __future__ import annotations

import enum
import time

from tinyvllm.checkpoint.tokenizer import IncrementalDetokenizer
from tinyvllm.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"                  # queued; also a preempted sequence waiting to recompute
    RUNNING = "running"                  # prompt is in the KV cache; decoding
    FINISHED_STOPPED = "stop"            # EOS, a stop token id or a stop string (see stop_reason)
    FINISHED_LENGTH = "length"           # max_tokens, or the context limit
    FINISHED_ABORTED = "abort"           # abort_request()
    FINISHED_ERROR = "error"             # this request alone failed (Sequence.error says why)

    def __init__(self, value: str):
        # a plain attribute set once per member (Enum calls __init__ with the value), not a
        # property: it is read for every sequence on every step, and an Enum's .name is slow
        self.is_finished = value not in ("waiting", "running")


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, detokenizer: IncrementalDetokenizer,
                 arrival_time: float | None = None, index: int = 0):
        self.request_id = request_id
        self.index = index                          # which of the request's n samples
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.token_ids = list(prompt_token_ids)     # prompt + generated: what the model has seen
        self.params = params
        self.seed = seed                            # params.seed, or one drawn by the engine
        self.stop_strings = params.stop_strings     # params' derived values, read every step
        self.stop_token_ids = params.stop_token_id_set
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []            # physical KV blocks, in logical order
        self.block_table_row: int | None = None     # its copy's row in BlockManager.tables
        self.num_cached_tokens = 0                  # tokens whose K/V are in the cache
        self.num_scheduled_tokens = 0               # tokens fed to the model in this step
        self.block_hashes: list[bytes] = []         # chain hashes of its full blocks (prefix cache)
        self.num_published_blocks = 0               # of its blocks, those the cache has seen
        self.num_prefix_cached_tokens = 0           # prompt tokens the prefix cache served at admission
        self.num_preemptions = 0
        self.error: str | None = None               # why it failed (status FINISHED_ERROR)
        self.stop_reason: str | int | None = None   # the stop string / stop token id that ended it
        # logprobs (params.logprobs not None): per generated token, its entry (outputs.Logprob dict)
        self.logprobs: list[dict] | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.detokenizer = detokenizer
        self.text = ""                              # generated text, stop string cut off
        self.num_emitted_chars = 0                  # text[:num_emitted_chars] has been reported
        self.num_reported_tokens = 0                # output tokens already in a RequestOutput
        self.finish_reported = False                # its finish is in a RequestOutput
        # Text on demand (sequences without stop strings, see text_reported)
        self.text_pieces: list[str] = []            # the detokenizer's piece for each token fed
        self.num_text_tokens: int | None = None     # once finished: output tokens that are text
        self.flush_text = False                     # once finished: flush the detokenizer
        self.final_text: str | None = None
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # engine/logit_edits.py's SequenceEdits (its logit edits, kept from step to step), made
        # on first use, or logit_edits.PLAIN / NO_EDITS. A copy of this sequence (n > 1) must start at None.
        self.sampler_state = None
        # structured/grammar.py's Constraint (its grammar matcher) when the request has
        # structured_outputs, each sample its own; None otherwise
        self.constraint = None

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    @property
    def detokenizes_every_step(self) -> bool:
        """Stop strings need the text as it grows; any other sequence is detokenized only when
        someone reads its text (RequestOutput.text / delta_text), which offline generation does
        once, at the end."""
        return bool(self.stop_strings)

    def finish(self, status: SequenceStatus) -> None:
        """(A finish the output processor did not make — abort, error, out of KV cache — keeps
        the text as it stood: no flush of the detokenizer.)"""
        if self.num_text_tokens is None:
            self.end_text(self.num_output_tokens, flush=False)
        self.status = status
        self.finish_time = time.perf_counter()

    def take_new_text(self) -> str:
        """(Sequences detokenized every step.) The text not yet reported. While running, the
        last (longest stop string - 1) characters are held back: they might turn out to be the
        start of a stop string."""
        hold = 0 if self.is_finished or self.params.include_stop_str_in_output else \
            max((len(s) for s in self.stop_strings), default=1) - 1
        end = max(self.num_emitted_chars, len(self.text) - hold)
        new = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return new

    # -- text on demand -----------------------------------------------------------------------
    # The text an output reports is exactly what detokenizing every step would have reported:
    # the detokenizer is fed the same tokens one by one (its piece for each is kept, so outputs
    # can be read in any order) and flushed at the same finishes. Only when the final text is
    # the first thing read is it decoded in one call instead, which gives the same text because
    # the detokenizer's pieces concatenate to decode(all ids).
    def text_reported(self, num_output_tokens: int, final: bool) -> str:
        """The whole text of the output that covered this many generated tokens."""
        if not final:
            self._feed_detokenizer(num_output_tokens)
            return "".join(self.text_pieces[:num_output_tokens])
        if self.final_text is None:
            ids = self.token_ids[self.num_prompt_tokens:self.num_prompt_tokens + self.num_text_tokens]
            if not self.text_pieces and self.flush_text:
                self.final_text = self.detokenizer.decode_all(ids)
            else:
                self._feed_detokenizer(self.num_text_tokens)
                tail = self.detokenizer.flush() if self.flush_text else ""
                self.final_text = "".join(self.text_pieces[:self.num_text_tokens]) + tail
        return self.final_text

    def delta_text_reported(self, start: int, end: int, final: bool) -> str:
        """The text new in the output that covered generated tokens [start, end)."""
        if not final:                     # streaming: just the pieces of the new tokens
            self._feed_detokenizer(end)
            return "".join(self.text_pieces[start:end])
        return self.text_reported(end, True)[len(self.text_reported(start, False)):]

    def _feed_detokenizer(self, num_output_tokens: int) -> None:
        p, fed = self.num_prompt_tokens, len(self.text_pieces)
        for token in self.token_ids[p + fed:p + num_output_tokens]:
            self.text_pieces.append(self.detokenizer.add(token))

    def end_text(self, num_text_tokens: int, flush: bool) -> None:
        """At a finish (text on demand): which generated tokens are text (a stop token or EOS
        is not), and whether the detokenizer's held-back tail is released."""
        self.num_text_tokens, self.flush_text = num_text_tokens, flush


class Request:
    """One add_request: the prompt, its params, and its n sequences (samples). Sample 0 runs
    first; with prefix caching on, the other n - 1 wait in `held` until its prompt's KV blocks
    are computed and published, then start from them (LLMEngine._release_samples)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seqs: list[Sequence]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = seqs[0].prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.held: list[Sequence] = seqs[1:]      # not yet given to the scheduler
        self.prompt_logprobs: list[dict | None] | None = None
        self.arrival_time = seqs[0].arrival_time

    @property
    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, n={len(self.seqs)}, held={len(self.held)})"
