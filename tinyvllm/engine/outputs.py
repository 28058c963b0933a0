"""RequestOutput: what the engine reports about one request after a step."""
from __future__ import annotations

from tinyvllm.engine.sequence import Sequence


class RequestOutput:
    """What the engine reports about one request after a step.

    Made for every request that got a token, on every step, but most are never read (offline
    generation reads `finished` only), so making one is cheap: it notes how far the sequence
    had got, and the token lists, text and timings are worked out when first read. Every field
    reads as a snapshot of the moment it was reported."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "finished", "num_preemptions", "num_cached_tokens", "error",
                 "_seq", "_status", "_start", "_end", "_text", "_delta_text", "_token_ids")

    def __init__(self, seq: Sequence):
        """Report a sequence's progress since its previous RequestOutput."""
        self.request_id = seq.request_id
        self.prompt = seq.prompt
        self.prompt_token_ids = seq.prompt_token_ids
        self._seq, self._status = seq, seq.status
        self.finished = seq.status.is_finished
        self.num_preemptions = seq.num_preemptions
        self.num_cached_tokens = seq.num_prefix_cached_tokens    # prompt tokens served by the prefix cache
        self.error = seq.error            # set when finish_reason is "error": what went wrong
        self._start, self._end = seq.num_reported_tokens, len(seq.token_ids) - seq.num_prompt_tokens
        seq.num_reported_tokens = self._end
        self._token_ids = None
        if seq.detokenizes_every_step:
            self._delta_text = seq.take_new_text()
            self._text = seq.text[:seq.num_emitted_chars]
        else:
            self._text = self._delta_text = None

    @property
    def text(self) -> str:
        """All text reported so far (a stop string excluded)."""
        if self._text is None:
            self._text = self._seq.text_reported(self._end, self.finished)
        return self._text

    @property
    def delta_text(self) -> str:
        """The text new since this request's previous RequestOutput."""
        if self._delta_text is None:
            self._delta_text = self._seq.delta_text_reported(self._start, self._end, self.finished)
        return self._delta_text

    @property
    def token_ids(self) -> list[int]:
        """All generated token ids so far."""
        if self._token_ids is None:
            p = self._seq.num_prompt_tokens
            self._token_ids = self._seq.token_ids[p:p + self._end]
        return self._token_ids

    @property
    def num_generated_tokens(self) -> int:
        """len(token_ids), without making the list."""
        return self._end

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        """"stop", "eos", "length", "abort", "error" (see .error), or None while running."""
        return self._status.value if self.finished else None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first token."""
        seq = self._seq
        return None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to finish."""
        return self._seq.finish_time - self._seq.arrival_time if self.finished else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first / time after the first."""
        seq = self._seq
        if not self.finished or seq.first_token_time is None or self._end <= 1:
            return None
        decode_time = seq.finish_time - seq.first_token_time
        return (self._end - 1) / decode_time if decode_time > 0 else None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, text={self.text!r}, "
                f"token_ids={self.token_ids}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r})")
