"""SamplingParams: how one request wants its tokens chosen and when it stops — vLLM's fields,
names, defaults and meanings (docs/engine.md has the table, with where tinyvllm differs).

Frozen, and validated when made: a SamplingParams that exists is one the engine accepts, except
for the bounds that depend on the model (vocabulary, context, max_num_seqs), which
LLMEngine.add_request checks (engine/limits.py: check_request)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tinyvllm.engine.limits import check_sampling
from tinyvllm.errors import InvalidRequestError
from tinyvllm.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20             # vLLM's default max_logprobs


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                        # independent samples of the one prompt (one prefill)
    best_of: int | None = None        # not supported beyond n (vLLM V1 dropped it too)
    presence_penalty: float = 0.0     # in [-2, 2]: subtracted once from every token already output
    frequency_penalty: float = 0.0    # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0   # > 0: HF's, over prompt + output (1 = off)
    temperature: float = 1.0          # 0 = greedy (argmax)
    top_p: float = 1.0                # in (0, 1]; 1 = off
    top_k: int = -1                   # <= 0 = off (vLLM: 0 or -1)
    min_p: float = 0.0                # in [0, 1]: drop tokens below min_p * the top probability
    seed: int | None = None           # None: the engine draws one from its own seeded generator
    stop: str | list[str] | None = None        # stop strings (see include_stop_str_in_output)
    stop_token_ids: list[int] | None = field(default_factory=list)   # finish_reason "stop"
    ignore_eos: bool = False          # keep generating past the model's EOS tokens
    max_tokens: int = 16              # generated tokens, >= 1
    min_tokens: int = 0               # no EOS / stop token / stop string before this many tokens
    logprobs: int | None = None       # None: none; k: the sampled token's + the top k per token
    prompt_logprobs: int | None = None   # the same for every prompt token after the first
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # the output must match this JSON schema / regex / choice / grammar (tinyvllm/structured/)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_token_id_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> SamplingParams:
        """Raise InvalidRequestError naming the first bad field; return self when all is fine.
        (Run when made; again by add_request, for a params whose fields were forced since.)"""
        def bad(name, why):
            raise InvalidRequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", "is not supported (only best_of=None or best_of=n): use n")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                bad(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a finite number > 0 (1 means off)")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k):
            bad("top_k", "must be an integer (<= 0 disables top-k)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            bad("seed", "must be None or an integer in [0, 2**64)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens!r}]")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                bad("stop", "must be a non-empty string or a list of non-empty strings")
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(k) and k >= 0 and _is_number(v) and math.isfinite(v) and -100 <= v <= 100
                    for k, v in self.logit_bias.items()):
                bad("logit_bias", "must map token ids (integers >= 0) to numbers in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        check_sampling(self)           # the array bounds (limits.py)
        return self
