"""Admission limits: the one table of what a request's numbers may be, so that every value the
engine accepts fits the arrays and kernels it ends up in (int32 ids and counts, float32 values,
uint64 seeds) and no request can make a step slow or huge for its neighbours (caps on stop
strings, stop ids, logit_bias entries, samples, prompt bytes).

SamplingParams.validate() checks the meaning of each field (top_p in (0, 1], ...); check_sampling
adds these bounds, and check_request the ones that depend on the model (vocabulary, context,
batch size). docs/server.md's limits table is LIMITS, word for word (tests/test_admission.py).
Also here: the checks on a prompt's text before it is tokenized, and the start-up check that
the KV cache holds one whole context.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from tinyvllm.config import AUTO, EngineConfig, ModelConfig
from tinyvllm.errors import InvalidRequestError, TinyVLLMError

log = logging.getLogger("tinyvllm")

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")      # 3.4028235e38: larger becomes inf in float32
MAX_STOP_STRINGS = 16            # each is searched for in the new text after every token
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024            # entries: one scatter per row and step
MAX_N = 64                       # samples per request (each is a sequence of its own)


@dataclass(frozen=True)
class Limit:
    field: str
    low: str                     # as written in the table; "vocab" / "context" / "max_num_seqs"
    high: str                    #   are resolved per engine (see bound())
    why: str


LIMITS = (
    Limit("n", "1", f"min({MAX_N}, max_num_seqs)", "each sample is a sequence in the batch"),
    Limit("max_tokens", "1", "context - prompt tokens",
          "server: above it a 400; offline (as vLLM): up to 2**31 - 1, generation stops at the context"),
    Limit("min_tokens", "0", "max_tokens", "int32 step counter"),
    Limit("temperature", "0", "3.4028235e38", "float32, finite"),
    Limit("top_k", "-1", str(INT32_MAX), "int32 in the sampling batch"),
    Limit("top_p", "> 0", "1", "float32"),
    Limit("min_p", "0", "1", "float32"),
    Limit("presence_penalty", "-2", "2", "float32, OpenAI's range"),
    Limit("frequency_penalty", "-2", "2", "float32, OpenAI's range"),
    Limit("repetition_penalty", "> 0", "3.4028235e38", "float32, finite"),
    Limit("seed", "0", "2**64 - 1", "uint64"),
    Limit("logprobs", "0", "20", "vLLM's max_logprobs"),
    Limit("prompt_logprobs", "0", "20", "vLLM's max_logprobs"),
    Limit("stop (count)", "0", str(MAX_STOP_STRINGS), "each is searched for after every token"),
    Limit("stop (characters each)", "1", str(MAX_STOP_STRING_CHARS), "the held-back text per stream"),
    Limit("stop_token_ids (count)", "0", str(MAX_STOP_TOKEN_IDS), "a set lookup per token"),
    Limit("stop_token_ids (each)", "0", "vocab - 1", "int32 token ids"),
    Limit("logit_bias (entries)", "0", str(MAX_LOGIT_BIAS), "int32 counts, one scatter per step"),
    Limit("logit_bias (token id)", "0", "vocab - 1", "int32 token ids"),
    Limit("logit_bias (value)", "-100", "100", "OpenAI's range"),
    Limit("prompt (token ids)", "0", "vocab - 1", "int32 token ids"),
    Limit("prompt (tokens)", "1", "context - 1", "at least one token must be generated"),
    Limit("prompt (UTF-8 bytes)", "1", "context * longest token", "refused before tokenizing"),
)


def _bad(name: str, value, why: str):
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise InvalidRequestError(f"invalid sampling parameter {name}={shown}: {why}")


def _int_in(params, name: str, low: int, high: int, what: str = "") -> None:
    value = getattr(params, name, None)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        _bad(name, value, f"must be an integer in [{low}, {high}]{what}")


def _float32(params, name: str) -> None:
    value = getattr(params, name, None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and \
            (not math.isfinite(value) or abs(value) > FLOAT32_MAX):
        _bad(name, value, "must be a finite float32 (|x| <= 3.4028235e38)")


def check_sampling(params) -> None:
    """The bounds of LIMITS that do not depend on the model. Fields a SamplingParams lacks (or
    leaves None) are skipped."""
    _int_in(params, "n", 1, MAX_N)
    _int_in(params, "max_tokens", 1, INT32_MAX)
    _int_in(params, "min_tokens", 0, INT32_MAX)
    _int_in(params, "top_k", -1, INT32_MAX, " (int32)")
    _int_in(params, "seed", 0, 2**64 - 1, " (uint64)")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        _float32(params, name)
    stops = getattr(params, "stop", None)
    stops = [stops] if isinstance(stops, str) else list(stops or ())
    if len(stops) > MAX_STOP_STRINGS:
        _bad("stop", f"{len(stops)} strings", f"at most {MAX_STOP_STRINGS} stop strings")
    for s in stops:
        if isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS:
            _bad("stop", s, f"each stop string has at most {MAX_STOP_STRING_CHARS} characters")
    ids = getattr(params, "stop_token_ids", None) or ()
    if isinstance(ids, (list, tuple)) and len(ids) > MAX_STOP_TOKEN_IDS:
        _bad("stop_token_ids", f"{len(ids)} ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    bias = getattr(params, "logit_bias", None) or {}     # its values' range: SamplingParams.validate
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        _bad("logit_bias", f"{len(bias)} entries", f"at most {MAX_LOGIT_BIAS} entries")


def check_request(params, vocab_size: int, max_num_seqs: int) -> None:
    """The bounds of LIMITS that depend on the model and the engine (the context is checked
    where the prompt's length is known: LLMEngine.add_request)."""
    check_sampling(params)
    n = getattr(params, "n", 1)
    if n > max_num_seqs:
        _bad("n", n, f"must be at most max_num_seqs ({max_num_seqs}): each sample is a sequence")
    for name in ("stop_token_ids", "logit_bias"):
        ids = getattr(params, name, None) or ()
        outside = sorted(t for t in ids if isinstance(t, int) and not 0 <= t < vocab_size)
        if outside:
            _bad(name, outside[:8], f"token ids must be in [0, {vocab_size - 1}]")


def max_prompt_bytes(context_limit: int, longest_token_bytes: int) -> int:
    """No tokenization of a text longer than this can fit the context: each token covers at
    most longest_token_bytes bytes of it."""
    return context_limit * longest_token_bytes


def check_text(text: str, field: str, max_bytes: int | None) -> None:
    """Before tokenizing: a str can hold lone surrogates (JSON's "\\ud800"), which no tokenizer
    can encode; and a text of more than max_bytes UTF-8 bytes cannot fit the context however it
    is tokenized (limits.max_prompt_bytes), so it is refused without spending seconds on it."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{field} is not valid Unicode: {e.reason} at character "
                                  f"{e.start} ({text[e.start]!r})") from None
    if max_bytes is not None and size > max_bytes:
        raise InvalidRequestError(f"{field} is {size} bytes of UTF-8: more than any text that fits the "
                                  f"context ({max_bytes} bytes at most)")


def longest_token_bytes(tokenizer) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token covers: its vocabulary string's own
    UTF-8 length (byte-level and SentencePiece pieces are never shorter than the text they stand
    for). None when a normalizer could shrink the text first (then no such bound holds)."""
    backend = tokenizer.backend
    if getattr(backend, "normalizer", None) is not None:
        return None
    return max(len(piece.encode("utf-8")) for piece in backend.get_vocab(with_added_tokens=True))


def fit_context_to_cache(engine_config: EngineConfig, model_config: ModelConfig,
                         num_kv_blocks: int) -> EngineConfig:
    """The engine config with a context limit the KV cache can hold one whole sequence of.
    A cache too small for max_model_len is refused (a server would advertise a context it
    cannot serve), unless max_model_len="auto" asked for the limit to be lowered to fit."""
    limit = engine_config.context_limit(model_config)
    holds = num_kv_blocks * engine_config.block_size
    if holds >= limit:
        return engine_config
    if engine_config.max_model_len == AUTO:
        log.warning("max_model_len lowered from %d to %d: the KV cache (%d blocks of %d tokens) "
                    "holds no more", limit, holds, num_kv_blocks, engine_config.block_size)
        return dataclasses.replace(engine_config, max_model_len=holds)
    raise TinyVLLMError(
        f"the KV cache holds {holds} tokens ({num_kv_blocks} blocks of {engine_config.block_size}), "
        f"less than one sequence of max_model_len={limit}: give it more memory (--kv-cache-gb, "
        "--num-kv-blocks, --gpu-memory-utilization), lower --max-model-len, or pass "
        "--max-model-len auto to fit the context to the cache")
