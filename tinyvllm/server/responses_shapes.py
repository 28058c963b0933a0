"""The Responses API's bodies, as plain dicts in OpenAI's shapes: the response object, its output
items (a message of output_text, function calls) and the streamed events, each with its
sequence_number. server/responses_api.py fills them in."""
from __future__ import annotations

import time
import uuid

from tinyvllm.server import responses as R


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseState:
    """One response as it is built: its id, the request's echoed settings, its output items."""

    def __init__(self, model: str, request: dict):
        self.id, self.model, self.request = new_id("resp"), model, request
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.sequence_number = 0

    def body(self, status: str, input_tokens: int = 0, output_tokens: int = 0,
             incomplete_reason: str | None = None) -> dict:
        r = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": list(self.output), "error": None,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": r.get("instructions"), "max_output_tokens": r.get("max_output_tokens"),
            "metadata": r.get("metadata") or {}, "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": None, "store": False, "temperature": r.get("temperature"),
            "top_p": r.get("top_p"), "tool_choice": r.get("tool_choice") or "auto", "tools": r.get("tools") or [],
            "text": r.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": None if status == "in_progress" else {
                "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens}}

    def event(self, kind: str, **fields) -> bytes:
        """One SSE event: `event: <type>` and its data, as OpenAI streams them."""
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n".encode() + R.sse(payload).encode()


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [] if status == "in_progress" else [output_text(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"), "name": name,
            "arguments": arguments, "status": status}


def text_events(state: ResponseState, item_id: str, output_index: int, deltas) -> list[bytes]:
    """The opening events of a message item (added, content part added); its deltas come from
    text_delta, its end from text_done."""
    return [state.event("response.output_item.added", output_index=output_index,
                        item=message_item(item_id, "", "in_progress")),
            state.event("response.content_part.added", item_id=item_id, output_index=output_index,
                        content_index=0, part=output_text(""))] + [
        text_delta(state, item_id, output_index, d) for d in deltas]


def text_delta(state: ResponseState, item_id: str, output_index: int, delta: str) -> bytes:
    return state.event("response.output_text.delta", item_id=item_id, output_index=output_index,
                       content_index=0, delta=delta, logprobs=[])


def text_done(state: ResponseState, item_id: str, output_index: int, text: str) -> list[bytes]:
    item = message_item(item_id, text)
    state.output.append(item)
    return [state.event("response.output_text.done", item_id=item_id, output_index=output_index,
                        content_index=0, text=text, logprobs=[]),
            state.event("response.content_part.done", item_id=item_id, output_index=output_index,
                        content_index=0, part=output_text(text)),
            state.event("response.output_item.done", output_index=output_index, item=item)]


def function_call_events(state: ResponseState, item: dict) -> list[bytes]:
    """A finished function call as its added / arguments delta / done events."""
    index = len(state.output)
    state.output.append(item)
    return [state.event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"}),
            state.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"]),
            state.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"]),
            state.event("response.output_item.done", output_index=index, item=item)]
