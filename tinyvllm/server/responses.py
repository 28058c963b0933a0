"""OpenAI response bodies, as plain dicts: the non-streamed objects, the SSE chunks, usage and
the error body. One place, so both endpoints agree on field names."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

# The engine says "eos" when the model emitted an end-of-sequence token; OpenAI calls that "stop".
_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def openai_finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _FINISH_REASONS.get(reason, reason)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An error body holds no file paths: an exception's text may name a file of the server's
    (the model directory, a module), which only the operator's log should show."""
    return {"error": {"message": public_message(message), "type": type_, "param": param, "code": code}}


# An absolute path of two or more parts, at the start or after a space, quote, bracket or "=".
_PATH = re.compile(r"""(?:(?<=^)|(?<=[\s'"(\[=:,]))/(?:[^\s'"()\[\],/]+/)+[^\s'"()\[\],:]*""")


def public_message(message: str) -> str:
    """The message with absolute file paths replaced by <path>, and text no UTF-8 can carry (a
    lone surrogate a client sent, quoted back in the message) escaped."""
    return _PATH.sub("<path>", message).encode("utf-8", "backslashreplace").decode("utf-8")


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


def choice(ident: ResponseIdentity, index: int, text: str, finish_reason: str | None,
           logprobs: dict | None = None) -> dict:
    if ident.chat:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": openai_finish_reason(finish_reason)}
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": openai_finish_reason(finish_reason)}


def response(ident: ResponseIdentity, choices: list[dict], prompt_tokens: int,
             completion_tokens: int) -> dict:
    return {"id": ident.id, "object": ident.object_name, "created": ident.created,
            "model": ident.model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def full_response(ident: ResponseIdentity, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int, index: int = 0) -> dict:
    return response(ident, [choice(ident, index, text, finish_reason)], prompt_tokens, completion_tokens)


# -- logprobs, in OpenAI's two formats (vLLM's choices: -inf is sent as -9999.0, JSON has no inf) --
def _lp(x: float) -> float:
    return max(x, -9999.0)


def completion_logprobs(token_ids: list[int], entries: list[dict], k: int, text_offset: int = 0) -> dict:
    """/v1/completions: {tokens, token_logprobs, top_logprobs, text_offset}; each top_logprobs
    item maps the decoded top-k tokens (and the sampled one) to their logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        tokens.append(chosen.decoded_token)
        token_lps.append(_lp(chosen.logprob))
        tops.append({e.decoded_token: _lp(e.logprob) for e in entry.values()})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(first_token: str, prompt_ids: list[int], prompt_logprobs: list, k: int,
                  completion: dict) -> dict:
    """echo + logprobs: the prompt's tokens (the first has no logprob: nothing predicts it),
    then the completion's (`completion`, made with text_offset = the echoed text's length)."""
    prompt = completion_logprobs(prompt_ids[1:], prompt_logprobs[1:], k, len(first_token))
    return {"tokens": [first_token] + prompt["tokens"] + completion["tokens"],
            "token_logprobs": [None] + prompt["token_logprobs"] + completion["token_logprobs"],
            "top_logprobs": [None] + prompt["top_logprobs"] + completion["top_logprobs"],
            "text_offset": [0] + prompt["text_offset"] + completion["text_offset"]}


def chat_logprobs(token_ids: list[int], entries: list[dict], k: int) -> dict:
    """/v1/chat/completions: {content: [{token, logprob, bytes, top_logprobs: [the top k]}]}."""
    def item(e) -> dict:
        return {"token": e.decoded_token, "logprob": _lp(e.logprob),
                "bytes": list(e.decoded_token.encode("utf-8"))}
    content = []
    for token, entry in zip(token_ids, entries):
        top = sorted((e for e in entry.values() if e.rank is not None and e.rank <= k), key=lambda e: e.rank)
        content.append({**item(entry[token]), "top_logprobs": [item(e) for e in top]})
    return {"content": content}


def chunk(ident: ResponseIdentity, text: str, finish_reason: str | None = None,
          first: bool = False, with_usage_field: bool = False, index: int = 0,
          logprobs: dict | None = None) -> dict:
    """One streamed choice. The first chat chunk carries the assistant role, as OpenAI's does."""
    if ident.chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": openai_finish_reason(finish_reason)}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": openai_finish_reason(finish_reason)}
    body = {"id": ident.id, "object": ident.chunk_object_name, "created": ident.created,
            "model": ident.model, "choices": [choice]}
    if with_usage_field:       # with include_usage, OpenAI sends "usage": null until the last chunk
        body["usage"] = None
    return body


def usage_chunk(ident: ResponseIdentity, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": ident.id, "object": ident.chunk_object_name, "created": ident.created,
            "model": ident.model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


class StreamEncoder:
    """The SSE bytes of one stream, identical to sse(chunk(...)) / sse(usage_chunk(...)), with the
    common case, a text chunk without a finish reason, built from a template made once per
    request: json.dumps runs on the text alone, not on a fresh dict per token."""

    def __init__(self, ident: ResponseIdentity, include_usage: bool, index: int = 0):
        self.ident, self.include_usage, self.index = ident, include_usage, index
        # The text is the last field that can hold a NUL (the fields after it are fixed).
        head, _, tail = sse(chunk(ident, "\0", with_usage_field=include_usage,
                                  index=index)).rpartition('"\\u0000"')
        self._head, self._tail = head.encode(), tail.encode()

    def text(self, text: str) -> bytes:
        """A chunk carrying `text` (non-empty), not the last one."""
        return self._head + json.dumps(text, ensure_ascii=False).encode() + self._tail

    def event(self, text: str, finish_reason: str | None = None, first: bool = False,
              logprobs: dict | None = None) -> bytes:
        if text and finish_reason is None and not first and logprobs is None:
            return self.text(text)
        return sse(chunk(self.ident, text, finish_reason, first=first,
                         with_usage_field=self.include_usage, index=self.index, logprobs=logprobs)).encode()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse(usage_chunk(self.ident, prompt_tokens, completion_tokens)).encode()
