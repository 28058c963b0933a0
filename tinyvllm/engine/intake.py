"""Request intake: the checks and conversions LLMEngine.add_request makes before the engine changes
at all. Anything wrong with a request is one InvalidRequestError naming the problem.

A prompt is text (tokenized here), a list of token ids, or a TokenizedPrompt (ids encoded by the
caller: the server encodes in a worker pool, server/encoding.py). A request with
SamplingParams.n > 1 is n sequences; sample j's random stream is seeded with sample_seed(seed, j).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tinyvllm.checkpoint.tokenizer import Tokenizer
from tinyvllm.engine.block_manager import BlockManager, blocks_for
from tinyvllm.engine.limits import check_text
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import InvalidRequestError, RequestValueError

MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt already encoded by the caller: add_request takes its ids as they are, with no
    tokenizing on the engine's thread. text is what RequestOutput.prompt reports (None: the ids
    were the prompt)."""
    text: str | None
    token_ids: tuple[int, ...]


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: the seed itself for sample 0 (so
    n=1 and sample 0 of n>1 agree), a splitmix64 mix of (seed, index) for the others (distinct
    streams, reproducible)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def prompt_ids(prompt, tokenizer: Tokenizer, vocab_size: int,
               max_prompt_bytes: int | None) -> tuple[str | None, list[int]]:
    """-> (the prompt's text, None for token ids; its token ids)."""
    if isinstance(prompt, TokenizedPrompt):
        return prompt.text, prompt_ids(list(prompt.token_ids), tokenizer, vocab_size, max_prompt_bytes)[1]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        check_text(prompt, "prompt", max_prompt_bytes)
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    if type(prompt) is list and prompt and set(map(type, prompt)) == {int}:
        # the server's token-id prompts (2-4k ids a request under load, parsed from JSON: plain
        # ints): type and range checked by C loops, ~0.1 ms for 3k ids against ~0.4 ms for the
        # general path's three Python passes, on the engine thread every step that admits one
        check_token_ids(prompt, vocab_size)
        return None, list(prompt)
    if isinstance(prompt, (list, tuple, np.ndarray)):
        ids = [int(t) for t in prompt] if all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt) else None
        if ids is None:
            raise InvalidRequestError("a token-id prompt must be a list of integers")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        check_token_ids(ids, vocab_size)
        return None, ids
    raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """A non-empty list of int token ids must lie in [0, vocab_size): min and max, C loops over
    a long list (the server checks its requests' id prompts with it too, on its event loop)."""
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise RequestValueError(f"prompt token ids must be in [0, {vocab_size})", "prompt")


def check_prompt_fits(num_tokens: int, context_limit: int, block_manager: BlockManager) -> None:
    """A prompt must leave room to generate, and fit the whole KV cache."""
    if num_tokens >= context_limit:
        raise InvalidRequestError(f"prompt is {num_tokens} tokens; the context limit is "
                                  f"{context_limit}, which leaves no room to generate")
    if blocks_for(num_tokens, block_manager.block_size) > block_manager.num_blocks:
        raise InvalidRequestError(
            f"prompt is {num_tokens} tokens but the whole KV cache holds only "
            f"{block_manager.num_blocks * block_manager.block_size}")


def check_supported(params: SamplingParams, runner: ModelRunner, device: str) -> None:
    """What the runner cannot honour is refused, never ignored (a runner that does not say it
    supports logprobs, e.g. a test fake, does not get them)."""
    if params.logprobs is not None and not getattr(runner, "supports_logprobs", False):
        raise InvalidRequestError(f"invalid sampling parameter logprobs={params.logprobs!r}: the "
                                  f"{device} runner does not return logprobs in this build")
    if params.prompt_logprobs is not None and not getattr(runner, "supports_prompt_logprobs", False):
        raise InvalidRequestError(
            f"invalid sampling parameter prompt_logprobs={params.prompt_logprobs!r}: not supported on "
            f"{device}: its forward pass computes the logits of each sequence's last position only")
