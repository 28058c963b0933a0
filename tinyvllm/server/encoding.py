"""Prompts to token ids off both the event loop and the engine thread.

Encoding a megabyte of text takes seconds. Done on the event loop it would freeze /health and
every running stream; done on the engine thread (add_request with a string) it would stall every
request's next token. So the server renders chat templates and encodes in a small thread pool
here, and hands the engine a TokenizedPrompt, which add_request takes as it is. The tokenizer's
encode (Tokenizer.encode: the `tokenizers` batch call) releases the GIL while it works, so the
other threads run meanwhile; Jinja rendering holds it, but is short next to encoding.

A text is checked before it is encoded (limits.check_text): a lone surrogate is a 400, and a
text longer than any that fits the context is refused without spending seconds on it."""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tinyvllm.checkpoint import content_tokens
from tinyvllm.engine.intake import TokenizedPrompt
from tinyvllm.engine.limits import check_text
from tinyvllm.errors import InvalidRequestError, RequestValueError

MAX_WORKERS = 4


class PromptEncoder:
    def __init__(self, engine, workers: int | None = None):
        self.tokenizer = engine.tokenizer
        content_tokens.prepare(self.tokenizer)    # its one-time cost here, not in a request
        self.max_prompt_bytes = engine.max_prompt_bytes
        self.vocab_size = engine.model_config.vocab_size
        workers = workers or max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tinyvllm-encode")

    async def run(self, fn: Callable, *args):
        """fn(*args) on a worker thread; its exceptions arrive here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prompts(self, prompts: list) -> list:
        """Completion prompts -> TokenizedPrompts (text ones encoded as a raw prompt is:
        add_special_tokens=True); token-id prompts pass through for the engine to check."""
        return [await self.run(self._encode_prompt, p) if isinstance(p, str) else p for p in prompts]

    def _encode_prompt(self, text: str) -> TokenizedPrompt:
        if not text:
            raise RequestValueError("prompt is empty", "prompt")
        _check(text, "prompt", self.max_prompt_bytes)
        return TokenizedPrompt(text, tuple(self.tokenizer.encode(text, add_special_tokens=True)))

    async def chat(self, render_and_encode: Callable[..., list[int]], messages: list[dict],
                   *args, fit_context: bool = True) -> list[int]:
        """render_and_encode(messages, *args) (the server's one chat path) on a worker, after
        every message's text is checked the way a prompt is (fit_context: and their total
        against the most text that can fit the context)."""
        texts = [t for m in messages for t in _texts(m.get("content")) + _texts(m.get("name"))]
        limit = self.max_prompt_bytes if fit_context else None
        total = sum(_check(t, "messages", limit) for t in texts)
        if limit is not None and total > limit:
            raise RequestValueError(f"the messages hold {total} bytes of UTF-8: more than any "
                                    f"conversation that fits the context ({self.max_prompt_bytes} "
                                    "bytes at most)", "messages")
        return await self.run(render_and_encode, messages, *args)

    async def text(self, text: str, add_special_tokens: bool) -> list[int]:
        """/tokenize's prompt."""
        _check(text, "prompt", None)
        return await self.run(self.tokenizer.encode, text, add_special_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check(text: str, field: str, max_bytes: int | None) -> int:
    """check_text, the error naming its field; -> the text's UTF-8 bytes."""
    try:
        check_text(text, field, max_bytes)
    except InvalidRequestError as e:
        raise RequestValueError(str(e), field) from None
    return len(text.encode("utf-8"))


def _texts(content) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []
