"""Tool calls in chat responses: the message of a choice that called tools, and the streamed
form (ToolStream), OpenAI's shapes.

Non-streamed, the whole text is parsed once (ToolPlan.parse): calls become message.tool_calls
(each {"id", "type": "function", "function": {"name", "arguments"}}, arguments a JSON string),
text before them the content (null when there is none), and finish_reason is "tool_calls"
("stop" for a named tool_choice, as vLLM).

Streamed, ToolStream sits between the engine's text deltas and the SSE chunks of one choice.
Text that cannot be the start of a call goes out as content deltas at once; text that may be is
held back until it is decided: a Hermes call when its </tool_call> arrives, a Llama 3 JSON
answer (one call, or content that happens to start with "{") when the choice finishes. Each
call goes out as one delta, {"tool_calls": [{"index", "id", "type", "function": {"name",
"arguments"}}]}, which clients accumulate by index exactly as they do OpenAI's finer pieces.
"""
from __future__ import annotations

import uuid

from tinyvllm.server import responses as R
from tinyvllm.structured import tool_calls as T


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_entry(call: T.ParsedCall, index: int | None = None) -> dict:
    entry = {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}


def tool_choice_body(plan, ident, index: int, text: str, finish_reason, logprobs) -> dict:
    """A non-streamed chat choice of a request with tools."""
    body = R.choice(ident, index, text, finish_reason, logprobs)
    content, calls = plan.parse(text)
    if calls:
        body["message"] = {"role": "assistant", "content": content,
                           "tool_calls": [tool_call_entry(c) for c in calls]}
        if finish_reason in ("stop", "eos"):
            body["finish_reason"] = plan.finish_reason
    return body


class ToolStream:
    """One streamed choice of a chat request with tools (module docstring)."""

    def __init__(self, plan, encoder: R.StreamEncoder):
        self.plan, self.encoder = plan, encoder
        self.hermes = plan.format.name == T.HERMES
        self.held = ""                   # text not sent yet
        self.in_calls = False            # Hermes: a <tool_call> has begun
        self.decided_content = False     # Llama 3 JSON: the answer is plain content
        self.num_calls = 0

    def feed(self, text: str) -> list[bytes]:
        """The chunks a new piece of text makes (often none while a call is being written)."""
        self.held += text
        if self.hermes:
            return self._hermes()
        if self.decided_content:
            return self._content(self._take())
        head = self.held.lstrip()
        if not head or head.startswith("{") or T.PYTHON_TAG.startswith(head[:len(T.PYTHON_TAG)]):
            return []                    # may be a call: decided at the end
        self.decided_content = True
        return self._content(self._take())

    def finish(self, finish_reason) -> list[bytes]:
        """The rest, and the closing chunk with the choice's finish_reason."""
        out, held = [], self._take()
        calls = self.plan.parse(held)[1] if held and (self.in_calls or not (self.hermes or self.decided_content)) else []
        if calls:                        # an unterminated Hermes call, or a Llama 3 JSON answer
            out += [self._call(c) for c in calls]
        elif held.strip() or (held and not self.num_calls):
            out += self._content(held)
        if self.num_calls and finish_reason in ("stop", "eos"):
            finish_reason = self.plan.finish_reason
        return out + [self.encoder.event("", finish_reason)]

    def _hermes(self) -> list[bytes]:
        out = []
        while True:
            if not self.in_calls:
                start = self.held.find(T.CALL_OPEN)
                if start < 0:             # send all but a tail that may begin <tool_call>
                    keep = next((k for k in range(min(len(self.held), len(T.CALL_OPEN) - 1), 0, -1)
                                 if T.CALL_OPEN.startswith(self.held[-k:])), 0)
                    sendable = self.held[:len(self.held) - keep]
                    self.held = self.held[len(sendable):]
                    return out + (self._content(sendable) if sendable and (sendable.strip() or not self.num_calls) else [])
                before, self.held = self.held[:start], self.held[start:]
                if before.strip():
                    out += self._content(before)
                self.in_calls = True
            end = self.held.find(T.CALL_CLOSE)
            if end < 0:
                return out
            segment, self.held = self.held[:end + len(T.CALL_CLOSE)], self.held[end + len(T.CALL_CLOSE):]
            self.in_calls = False
            _, calls = self.plan.parse(segment)
            out += [self._call(c) for c in calls] if calls else self._content(segment)

    def _take(self) -> str:
        text, self.held = self.held, ""
        return text

    def _content(self, text: str) -> list[bytes]:
        return [self.encoder.text(text)] if text else []

    def _call(self, call: T.ParsedCall) -> bytes:
        enc = self.encoder
        body = R.chunk(enc.ident, "", with_usage_field=enc.include_usage, index=enc.index)
        body["choices"][0]["delta"] = {"tool_calls": [tool_call_entry(call, self.num_calls)]}
        self.num_calls += 1
        return R.sse(body).encode()
