"""Sequence: everything the engine knows about one request, on one object. RequestOutput: what
the engine reports about it after a step."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"                  # queued; also a preempted sequence waiting to recompute
    RUNNING = "running"                  # prompt is in the KV cache; decoding
    FINISHED_STOPPED = "stop"            # stop string or stop token id
    FINISHED_EOS = "eos"                 # the model's end-of-sequence token
    FINISHED_LENGTH = "length"           # max_tokens, or the context limit
    FINISHED_ABORTED = "abort"           # abort_request()

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, detokenizer: IncrementalDetokenizer,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)     # prompt + generated: what the model has seen
        self.params = params
        self.seed = seed                            # params.seed, or one drawn by the engine
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []            # physical KV blocks, in logical order
        self.num_cached_tokens = 0                  # tokens whose K/V are in the cache
        self.num_scheduled_tokens = 0               # tokens fed to the model in this step
        self.num_preemptions = 0
        self.detokenizer = detokenizer
        self.text = ""                              # generated text, stop string cut off
        self.num_emitted_chars = 0                  # text[:num_emitted_chars] has been reported
        self.num_reported_tokens = 0                # output tokens already in a RequestOutput
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def finish(self, status: SequenceStatus) -> None:
        self.status = status
        self.finish_time = time.perf_counter()

    def take_new_text(self) -> str:
        """The text not yet reported. While running, the last (longest stop string - 1)
        characters are held back: they might turn out to be the start of a stop string."""
        hold = 0 if self.is_finished else max((len(s) for s in self.params.stop_strings), default=1) - 1
        end = max(self.num_emitted_chars, len(self.text) - hold)
        new = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return new


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str                        # all text reported so far (stop string excluded)
    token_ids: list[int]             # all generated token ids so far
    delta_text: str                  # text new since this request's previous RequestOutput
    delta_token_ids: list[int]       # token ids new since the previous RequestOutput
    finished: bool
    finish_reason: str | None        # "stop", "eos", "length", "abort" or None while running
    num_preemptions: int = 0
    time_to_first_token: float | None = None   # seconds from arrival to the first token
    latency: float | None = None               # seconds from arrival to finish
    decode_tokens_per_s: float | None = None   # tokens after the first / time after the first

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @classmethod
    def of(cls, seq: Sequence) -> "RequestOutput":
        """Report a sequence's progress since its previous RequestOutput."""
        delta_text = seq.take_new_text()
        ttft = latency = rate = None
        if seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival_time
        if seq.finish_time is not None:
            latency = seq.finish_time - seq.arrival_time
            if seq.first_token_time is not None and seq.num_output_tokens > 1:
                decode_time = seq.finish_time - seq.first_token_time
                rate = (seq.num_output_tokens - 1) / decode_time if decode_time > 0 else None
        generated = seq.output_token_ids
        delta_tokens, seq.num_reported_tokens = generated[seq.num_reported_tokens:], len(generated)
        return cls(request_id=seq.request_id, prompt=seq.prompt,
                   prompt_token_ids=seq.prompt_token_ids,
                   text=seq.text[:seq.num_emitted_chars], token_ids=generated,
                   delta_text=delta_text, delta_token_ids=delta_tokens,
                   finished=seq.is_finished, finish_reason=seq.finish_reason,
                   num_preemptions=seq.num_preemptions, time_to_first_token=ttft,
                   latency=latency, decode_tokens_per_s=rate)
