"""SamplingParams: how one request wants its tokens chosen and when it stops (vLLM's shape)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tinyvllm.errors import InvalidRequestError


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy (argmax)
    top_p: float = 1.0                # in (0, 1]; 1 = off
    top_k: int = -1                   # <= 0 = off
    seed: int | None = None           # None: the engine draws one from its own seeded generator
    max_tokens: int = 16              # generated tokens, >= 1
    stop: str | list[str] | None = None        # stop strings; not included in the output text
    stop_token_ids: list[int] | None = field(default_factory=list)   # finish_reason "stop"
    ignore_eos: bool = False          # keep generating past the model's EOS tokens
    presence_penalty: float = 0.0     # logit -= presence * (token generated before); 0 = off
    frequency_penalty: float = 0.0    # logit -= frequency * (times generated); 0 = off
    repetition_penalty: float = 1.0   # tokens of prompt + output: logit / p if > 0 else * p; 1 = off
    min_p: float = 0.0                # drop tokens below min_p x the top probability; 0 = off
    min_tokens: int = 0               # EOS and stop_token_ids are banned until this many tokens
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit
    logprobs: int | None = None       # per token: the sampled one's and the top-N log-probs

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
        """Raise InvalidRequestError naming the first bad field; return self when all is fine."""
        def bad(name, why):
            raise InvalidRequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k):
            bad("top_k", "must be an integer (<= 0 disables top-k)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            bad("seed", "must be None or an integer in [0, 2**64)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                bad("stop", "must be a non-empty string or a list of non-empty strings")
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be true or false")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                bad(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not (0 < self.repetition_penalty < math.inf):
            bad("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be a number in [0, 1]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.logit_bias is not None and (not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_number(b) and math.isfinite(b) for t, b in self.logit_bias.items())):
            bad("logit_bias", "must map non-negative token ids to finite numbers")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be None or an integer in [0, 20]")
        return self
