"""POST /v1/responses: OpenAI's Responses API, stateless.

    input              a string (one user message) or a list of items: messages ({"role",
                       "content"}: a string or input_text / output_text parts), function_call
                       and function_call_output items (a tool round trip)
    instructions       a system message before the input
    max_output_tokens, temperature, top_p
    tools              function tools ({"type": "function", "name", "description", "parameters"})
                       and tool_choice, as chat completions (server/structured_request.py)
    text.format        {"type": "json_schema", "name", "schema", "strict"} or json_object
    stream             the events the openai SDK reads: response.created, response.in_progress,
                       response.output_item.added, response.content_part.added,
                       response.output_text.delta ... done, response.function_call_arguments.*,
                       response.output_item.done, response.completed

The request becomes a chat request (the same template, constraint and tool-call parsing as
/v1/chat/completions); the output is a message item and/or function_call items. Nothing is
stored: previous_response_id, background and store=true's retrieval have nothing to work with,
so previous_response_id and background are a 400 (store is accepted and answered false).
With tools, a streamed response sends its items when the text is complete (a call is known
only then); without, output_text deltas go out as the engine makes them.
"""
from __future__ import annotations

import uuid
from typing import Any, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tinyvllm.errors import RequestValueError
from tinyvllm.server import responses as R
from tinyvllm.server import responses_shapes as S
from tinyvllm.server.protocol import ChatCompletionRequest
from tinyvllm.server.request_stream import EngineFailure
from tinyvllm.server.serving import EngineStreamingResponse, collect_all
from tinyvllm.server.structured_request import text_format_constraint


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    stream: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    previous_response_id: Optional[str] = None
    background: Optional[bool] = None
    user: Optional[str] = None

    def refuse_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise RequestValueError("previous_response_id is not supported: this server stores no responses; "
                                    "send the whole conversation in input", "previous_response_id")
        if self.background:
            raise RequestValueError("background responses are not supported (nothing is stored)", "background")

    def chat_body(self) -> ChatCompletionRequest:
        """The sampling fields as a chat completions body (text.format as its response_format)."""
        fmt = (self.text or {}).get("format")
        fields = dict(model=self.model, messages=[{"role": "user", "content": "-"}], max_tokens=self.max_output_tokens,
                      temperature=self.temperature, top_p=self.top_p)
        body = ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        if fmt is not None:
            text_format_constraint(fmt)               # a bad one is a 400 naming text.format
            body.response_format = ({"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
                                    if fmt.get("type") == "json_schema" else fmt)
        return body

    def messages(self) -> list[dict]:
        """input (and instructions) as chat template messages."""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
                role = "system" if item["role"] == "developer" else item["role"]
                out.append({"role": role, "content": _text(item.get("content"), i)})
            elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if out and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": item["call_id"],
                            "content": output if isinstance(output, str) else _text(output, i)})
            else:
                raise RequestValueError(f"input[{i}]: items must be messages (role user, assistant, system or "
                                        f"developer), function_call or function_call_output; got {kind!r}", "input")
        if not out or all(m["role"] == "system" for m in out):
            raise RequestValueError("input holds no message", "input")
        return out

    def chat_tools(self) -> list[dict] | None:
        """Responses' flat function tools in chat's shape."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise RequestValueError(f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}", "tools")
            out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                         if k in tool}})
        return out


def _text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestValueError(f"input[{index}]: content must be a string or a list of input_text parts", "input")


def add_responses_route(app, engine_loop, check_model, prepare, require_api_key) -> None:
    """prepare: the server's RequestPreparer (the chat routes' template, constraint and tools)."""

    @app.post("/v1/responses", dependencies=[Depends(require_api_key)])
    async def create_response(body: ResponsesRequest, request: Request):
        model = check_model(body.model)
        body.refuse_unsupported()
        chat = body.chat_body()
        prompt_ids, params, plan = await prepare.chat(chat, body.messages(), body.chat_tools(), body.tool_choice)
        state = S.ResponseState(model, body.model_dump(exclude_none=True))
        request_id = f"resp-{uuid.uuid4().hex}"
        streams = await engine_loop.submit_all([(request_id, prompt_ids)], params)
        if body.stream:
            return EngineStreamingResponse(engine_loop, streams, _events(state, streams[0], plan))
        results = await collect_all(engine_loop, request, streams)
        if results is None:
            return JSONResponse(R.error_body("client disconnected"), status_code=499)
        (samples, last), = results
        sample = samples[0]
        _finish(state, "".join(sample.parts), plan)
        return _closing(state, last.num_prompt_tokens, sample.num_generated_tokens, sample.finish_reason)


def _finish(state: S.ResponseState, text: str, plan) -> None:
    """The output items of the whole text (a message and/or function calls)."""
    content, calls = plan.parse(text) if plan is not None else (text, [])
    if content is not None and (content or not calls):
        state.output.append(S.message_item(S.new_id("msg"), content))
    for call in calls:
        state.output.append(S.function_call_item(call.name, call.arguments))


def _closing(state: S.ResponseState, input_tokens: int, output_tokens: int, finish_reason) -> dict:
    incomplete = "max_output_tokens" if finish_reason == "length" else None
    return state.body("incomplete" if incomplete else "completed", input_tokens, output_tokens, incomplete)


async def _events(state: S.ResponseState, stream, plan):
    yield state.event("response.created", response=state.body("in_progress"))
    yield state.event("response.in_progress", response=state.body("in_progress"))
    item_id, parts, opened, last = S.new_id("msg"), [], False, None
    while not stream.finished:
        try:
            events = await stream.next_events()
        except EngineFailure as e:
            failed = state.body("failed") | {"error": {"code": e.code, "message": str(e)}}
            yield state.event("response.failed", response=failed)
            return
        for event in events:
            last = event
            for s in event.samples:
                if s.delta_text:
                    parts.append(s.delta_text)
                    if plan is None:          # plain text streams as it comes
                        chunks = [S.text_delta(state, item_id, 0, s.delta_text)] if opened else \
                            S.text_events(state, item_id, 0, [s.delta_text])
                        opened = True
                        yield b"".join(chunks)
    sample = last.samples[-1] if last.samples else None
    text = "".join(parts)
    if plan is None:
        out = ([] if opened else S.text_events(state, item_id, 0, [])) + S.text_done(state, item_id, 0, text)
    else:
        out, (content, calls) = [], plan.parse(text)
        if content is not None and (content or not calls):
            out += S.text_events(state, item_id, 0, [content]) + S.text_done(state, item_id, 0, content)
        for call in calls:
            out += S.function_call_events(state, S.function_call_item(call.name, call.arguments))
    generated = sample.num_generated_tokens if sample else 0
    closing = _closing(state, last.num_prompt_tokens, generated, sample.finish_reason if sample else None)
    kind = "response.completed" if closing["status"] == "completed" else "response.incomplete"
    yield b"".join(out) + state.event(kind, response=closing)
