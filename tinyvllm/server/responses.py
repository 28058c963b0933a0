"""OpenAI response bodies, as plain dicts: the non-streamed objects, the SSE chunks, usage and
the error body. One place, so both endpoints agree on field names."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

# The engine says "eos" when the model emitted an end-of-sequence token; OpenAI calls that "stop".
_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def openai_finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _FINISH_REASONS.get(reason, reason)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass
class ResponseIdentity:
    """What every response and chunk of one request repeats."""
    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object_name(self) -> str:
        # Legacy completions stream "text_completion" objects; chat streams its own chunk type.
        return "chat.completion.chunk" if self.chat else "text_completion"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(ident: ResponseIdentity, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int) -> dict:
    if ident.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": openai_finish_reason(finish_reason)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": openai_finish_reason(finish_reason)}
    return {"id": ident.id, "object": ident.object_name, "created": ident.created,
            "model": ident.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(ident: ResponseIdentity, text: str, finish_reason: str | None = None,
          first: bool = False, with_usage_field: bool = False) -> dict:
    """One streamed choice. The first chat chunk carries the assistant role, as OpenAI's does."""
    if ident.chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None,
                  "finish_reason": openai_finish_reason(finish_reason)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": openai_finish_reason(finish_reason)}
    body = {"id": ident.id, "object": ident.chunk_object_name, "created": ident.created,
            "model": ident.model, "choices": [choice]}
    if with_usage_field:       # with include_usage, OpenAI sends "usage": null until the last chunk
        body["usage"] = None
    return body


def usage_chunk(ident: ResponseIdentity, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": ident.id, "object": ident.chunk_object_name, "created": ident.created,
            "model": ident.model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
