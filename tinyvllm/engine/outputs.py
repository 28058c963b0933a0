"""What the engine reports after a step, in vLLM's shape: one RequestOutput per request, holding
one CompletionOutput per sample (SamplingParams.n), and Logprob entries.

    out = llm.generate("Hello", SamplingParams(n=2, logprobs=1))[0]
    out.outputs[1].text, out.outputs[1].token_ids, out.outputs[1].logprobs[0]  # {id: Logprob}

Made for every request that got a token, on every step, but most are never read (offline
generation reads `finished` only), so making one is cheap: each CompletionOutput notes how far
its sequence had got, and the token lists and text are worked out when first read. Every field
reads as a snapshot of the moment it was reported.

Streaming (the server): each CompletionOutput also has delta_text / delta_token_ids /
delta_logprobs, what is new since its previous report (tinyvllm's; vLLM streams with
RequestOutputKind.DELTA instead)."""
from __future__ import annotations

from typing import NamedTuple

from tinyvllm.engine.sequence import Request, Sequence


class Logprob(NamedTuple):
    """vLLM's Logprob: the log-probability of a token, its rank among the vocabulary (1 = the
    most likely) and its text on its own."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput). finish_reason: "stop" (EOS, a stop
    token id or a stop string; stop_reason says which), "length", "abort", or tinyvllm's
    "error" (this request alone failed; .error says why); None while running."""

    __slots__ = ("index", "finish_reason", "stop_reason", "cumulative_logprob", "error", "is_new",
                 "_seq", "_start", "_end", "_finished", "_text", "_delta_text", "_token_ids")

    def __init__(self, seq: Sequence):
        self.index = seq.index
        self._seq = seq
        self._finished = finished = seq.status.is_finished
        self.finish_reason: str | None = seq.status.value if finished else None
        self.stop_reason: str | int | None = seq.stop_reason   # None for EOS and "length"
        self.cumulative_logprob: float | None = seq.cumulative_logprob
        self.error: str | None = seq.error     # tinyvllm's: why, when finish_reason is "error"
        self._start, self._end = seq.num_reported_tokens, len(seq.token_ids) - seq.num_prompt_tokens
        seq.num_reported_tokens = self._end
        # is_new: something to stream since the previous report (new tokens, or the finish)
        self.is_new = self._end > self._start or (finished and not seq.finish_reported)
        seq.finish_reported = finished
        self._token_ids = None
        if seq.detokenizes_every_step:
            self._delta_text = seq.take_new_text()
            self._text = seq.text[:seq.num_emitted_chars]
        else:
            self._text = self._delta_text = None

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def text(self) -> str:
        """All text generated so far (stop token and stop string excluded, unless
        include_stop_str_in_output)."""
        if self._text is None:
            self._text = self._seq.text_reported(self._end, self._finished)
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """All generated token ids so far (a stop token included, as in vLLM)."""
        if self._token_ids is None:
            p = self._seq.num_prompt_tokens
            self._token_ids = self._seq.token_ids[p:p + self._end]
        return self._token_ids

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """Per generated token: {token id: Logprob} of the top `logprobs` tokens and the sampled
        one; None when the request did not ask (SamplingParams.logprobs None)."""
        lp = self._seq.logprobs
        return None if lp is None else lp[:self._end]

    @property
    def delta_text(self) -> str:
        """The text new since this sample's previous report."""
        if self._delta_text is None:
            self._delta_text = self._seq.delta_text_reported(self._start, self._end, self._finished)
        return self._delta_text

    @property
    def delta_token_ids(self) -> list[int]:
        p = self._seq.num_prompt_tokens
        return self._seq.token_ids[p + self._start:p + self._end]

    @property
    def delta_logprobs(self) -> list[dict[int, Logprob]] | None:
        lp = self._seq.logprobs
        return None if lp is None else lp[self._start:self._end]

    @property
    def num_generated_tokens(self) -> int:
        """len(token_ids), without making the list."""
        return self._end

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"cumulative_logprob={self.cumulative_logprob}, finish_reason={self.finish_reason!r}, "
                f"stop_reason={self.stop_reason!r})")


class RequestMetrics:
    """A request's times (time.perf_counter() seconds, as every engine time) and preemptions."""

    __slots__ = ("arrival_time", "first_token_time", "finished_time", "num_preemptions",
                 "num_generated_tokens")

    def __init__(self, request: Request, finished: bool):
        seqs = request.seqs
        self.arrival_time = request.arrival_time
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        self.first_token_time = min(firsts) if firsts else None
        self.finished_time = max(s.finish_time for s in seqs) if finished else None
        self.num_preemptions = sum(s.num_preemptions for s in seqs)
        self.num_generated_tokens = sum(s.num_output_tokens for s in seqs)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to finish."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first of each sample / time after the first token."""
        n_after_first = self.num_generated_tokens - 1
        if self.finished_time is None or self.first_token_time is None or n_after_first < 1:
            return None
        decode_time = self.finished_time - self.first_token_time
        return n_after_first / decode_time if decode_time > 0 else None


class RequestOutput:
    """One request after a step (vLLM's RequestOutput). Beyond vLLM's fields: `error` (set when
    a sample finished with finish_reason "error": what went wrong)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs",
                 "finished", "num_cached_tokens", "error", "_request")

    def __init__(self, request: Request):
        self.request_id = request.request_id
        self.prompt = request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.prompt_logprobs = request.prompt_logprobs
        self.outputs = [CompletionOutput(s) for s in request.seqs]
        self.finished = all(o.finished for o in self.outputs)
        self.num_cached_tokens = request.seqs[0].num_prefix_cached_tokens   # served by the prefix cache
        self.error = next((s.error for s in request.seqs if s.error), None)
        self._request = request

    @property
    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self._request, self.finished)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, "
                f"finished={self.finished})")
