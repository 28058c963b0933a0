"""From accepted request to response: submit the prompt(s) to the engine loop, then either collect
the whole text (watching for the client to hang up) or stream it as SSE.

A batch of prompts (/v1/completions with a list) becomes one engine request per prompt, all
queued at once so they share the same steps; with n samples per prompt (one engine request of
n sequences), choice i * n + j is sample j of prompt i, in a non-streamed response and in the
streamed chunks alike, and the usage is summed (each prompt's tokens counted once)."""
from __future__ import annotations

import asyncio
import collections

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tinyvllm.errors import RequestValueError
from tinyvllm.server import responses as R
from tinyvllm.server.engine_loop import EngineFailure, EngineLoop, RequestStream
from tinyvllm.server.protocol import context_error
from tinyvllm.server.tool_stream import ToolStream, tool_choice_body

SSE_DONE = R.SSE_DONE.encode()


async def serve(engine_loop: EngineLoop, request: Request, ident: R.ResponseIdentity,
                prompts: list, params, stream: bool, include_usage: bool, echo: bool = False,
                tools=None):
    """n choices per prompt (SamplingParams.n): choice i * n + j is sample j of prompt i.
    tools: a chat request's ToolPlan (server/structured_request.py): its choices' text is read
    for tool calls (server/tool_stream.py)."""
    if not ident.chat:
        check_context(engine_loop.engine, prompts, params)
    ids = [ident.id] if len(prompts) == 1 else [f"{ident.id}-{i}" for i in range(len(prompts))]
    streams = await engine_loop.submit_all(list(zip(ids, prompts)), params)   # 400 if refused
    shape = _Shape(engine_loop.engine, ident, params, prompts if echo else None, tools)
    if stream:
        return EngineStreamingResponse(engine_loop, streams, _sse_events(streams, shape, include_usage))
    results = await collect_all(engine_loop, request, streams)
    if results is None:
        return JSONResponse(R.error_body("client disconnected"), status_code=499)
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, (samples, last) in enumerate(results):
        prompt_tokens += last.num_prompt_tokens
        for j in range(params.n):
            c = samples[j]
            completion_tokens += c.num_generated_tokens
            choices.append(shape.choice(i, j, "".join(c.parts), c.finish_reason, c.token_ids,
                                        c.logprobs, last))
    return R.response(ident, choices, prompt_tokens, completion_tokens)


async def collect_all(engine_loop: EngineLoop, request: Request, streams: list[RequestStream]):
    """Every stream's samples and last event, in order -> [(samples by index, last event)], or
    None when the client left first (its requests are aborted, their blocks freed). An engine
    failure re-raises here (-> 500)."""
    collect = asyncio.ensure_future(asyncio.gather(*(_collect(s) for s in streams)))
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():          # the client left (or we were cancelled): free its blocks
            collect.cancel()
            collect.add_done_callback(_retrieve)    # else asyncio logs its CancelledError
            for s in streams:
                engine_loop.abort(s.request_id)
    if not collect.done() or collect.cancelled():
        return None
    return collect.result()


def check_context(engine, prompts: list, params) -> None:
    """As vLLM: a completion whose prompt + max_tokens exceeds the context is a 400."""
    limit = engine.context_limit
    for prompt in prompts:
        n = len(prompt) if isinstance(prompt, list) else len(engine.prompt_ids(prompt)[1])
        if n < limit and n + params.max_tokens > limit:
            raise RequestValueError(context_error(limit - n, params.max_tokens, limit, n), "max_tokens")


class _Sample:
    __slots__ = ("parts", "finish_reason", "num_generated_tokens", "token_ids", "logprobs")

    def __init__(self):
        self.parts, self.finish_reason, self.num_generated_tokens = [], None, 0
        self.token_ids, self.logprobs = [], None


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _collect(stream: RequestStream):
    samples: dict[int, _Sample] = collections.defaultdict(_Sample)
    while True:
        event = await stream.next_event()
        for s in event.samples:
            c = samples[s.index]
            c.parts.append(s.delta_text)
            c.finish_reason, c.num_generated_tokens = s.finish_reason, s.num_generated_tokens
            if s.delta_logprobs is not None:
                c.token_ids += s.delta_token_ids
                c.logprobs = (c.logprobs or []) + s.delta_logprobs
        if event.finished:
            return samples, event


def _prompt_text(engine, prompt) -> str:
    """What echo repeats: the prompt's own text, or its ids decoded (a token-id prompt). Server
    prompts arrive encoded already (intake.TokenizedPrompt: server/encoding.py)."""
    if isinstance(prompt, str):
        return prompt
    text = getattr(prompt, "text", None)
    if text is not None:
        return text
    ids = getattr(prompt, "token_ids", prompt)
    return engine.tokenizer.decode(list(ids), skip_special_tokens=False)


class _Shape:
    """How one request's choices look: their index, the echoed prompt, the logprobs format."""

    def __init__(self, engine, ident: R.ResponseIdentity, params, echo_prompts: list | None, tools=None):
        self.ident, self.n, self.engine, self.tools = ident, params.n, engine, tools
        self.k = params.logprobs
        self.echo = None if echo_prompts is None else [_prompt_text(engine, p) for p in echo_prompts]

    def index(self, prompt: int, sample: int) -> int:
        return prompt * self.n + sample

    def prefix(self, prompt: int) -> str:
        return "" if self.echo is None else self.echo[prompt]

    def choice(self, prompt: int, sample: int, text: str, finish_reason, token_ids, entries,
               last) -> dict:
        prefix = self.prefix(prompt)
        lp = None
        if self.k is not None and entries is not None:
            if self.ident.chat:
                lp = R.chat_logprobs(token_ids, entries, self.k)
            else:
                lp = R.completion_logprobs(token_ids, entries, self.k, len(prefix))
                if self.echo is not None and last.prompt_logprobs is not None:
                    ids = last.prompt_token_ids
                    first = self.engine.tokenizer.decode(ids[:1], skip_special_tokens=False)
                    lp = R.echo_logprobs(first, ids, last.prompt_logprobs, self.k, lp)
        if self.tools is not None:
            return tool_choice_body(self.tools, self.ident, self.index(prompt, sample), text, finish_reason, lp)
        return R.choice(self.ident, self.index(prompt, sample), prefix + text, finish_reason, lp)


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EngineStreamingResponse(StreamingResponse):
    """A text/event-stream response that aborts its requests however the response ends early:
    client disconnect (Starlette cancels the send loop), a send error, or server shutdown.
    This lives here rather than in the generator's `finally` because a generator that never
    started (client gone before the first chunk) never runs its `finally`."""

    def __init__(self, engine_loop: EngineLoop, streams: list[RequestStream], events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.engine_loop, self.streams = engine_loop, streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                if not stream.finished:
                    self.engine_loop.abort(stream.request_id)


async def _sse_events(streams: list[RequestStream], shape: _Shape, include_usage: bool):
    """The response body: chunks of every choice as they come, each with its index (every event
    a stream has pending goes out in one body chunk: SSE allows several `data:` events per
    chunk, so a stream that fell behind catches up in one write); one usage chunk (summed) and
    [DONE] once every prompt has finished."""
    ident, n = shape.ident, shape.n
    encoders: dict[int, R.StreamEncoder] = {}

    def encoder(i: int, j: int) -> R.StreamEncoder:
        index = shape.index(i, j)
        enc = encoders.get(index)
        if enc is None:
            enc = encoders[index] = R.StreamEncoder(ident, include_usage, index=index)
        return enc

    tool_streams: dict[int, ToolStream] = {}

    def tool_stream(i: int, j: int) -> ToolStream:
        index = shape.index(i, j)
        if index not in tool_streams:
            tool_streams[index] = ToolStream(shape.tools, encoder(i, j))
        return tool_streams[index]

    offsets = collections.defaultdict(int)        # text offsets of the completions logprobs
    first = []
    for i in range(len(streams)):
        for j in range(n):
            if ident.chat:        # OpenAI opens a chat stream with the role and empty content
                first.append(encoder(i, j).event("", first=True))
            elif shape.echo is not None:
                first.append(encoder(i, j).event(shape.prefix(i), first=True))
                offsets[shape.index(i, j)] = len(shape.prefix(i))
    if first:
        yield b"".join(first)
    waiting = {asyncio.ensure_future(s.next_events()): i for i, s in enumerate(streams)}
    prompt_tokens = completion_tokens = 0
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            parts = []
            for task in done:
                i = waiting.pop(task)
                try:
                    events = task.result()
                except EngineFailure as e:
                    yield b"".join(parts) + _failure(e)
                    return
                for event in events:
                    for s in event.samples:
                        enc = encoder(i, s.index)
                        if shape.tools is not None:       # text is held back while it may be a call
                            parts += tool_stream(i, s.index).feed(s.delta_text)
                            if s.finished:
                                parts += tool_stream(i, s.index).finish(s.finish_reason)
                        elif s.delta_logprobs is not None and shape.k is not None:
                            index = shape.index(i, s.index)
                            lp = (R.chat_logprobs(s.delta_token_ids, s.delta_logprobs, shape.k) if ident.chat
                                  else R.completion_logprobs(s.delta_token_ids, s.delta_logprobs, shape.k,
                                                             offsets[index]))
                            offsets[index] += len(s.delta_text)
                            parts.append(enc.event(s.delta_text, s.finish_reason, logprobs=lp))
                        elif s.finished:
                            parts.append(enc.event(s.delta_text, s.finish_reason))
                        elif s.delta_text:
                            parts.append(enc.text(s.delta_text))
                        if s.finished:
                            completion_tokens += s.num_generated_tokens
                    if event.finished:
                        prompt_tokens += event.num_prompt_tokens
                if not streams[i].finished:
                    waiting[asyncio.ensure_future(streams[i].next_events())] = i
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
        usage = encoder(0, 0).usage(prompt_tokens, completion_tokens) if include_usage else b""
        yield usage + SSE_DONE
    finally:
        for task in waiting:
            task.cancel()


def _failure(error: EngineFailure) -> bytes:
    return R.sse(R.error_body(str(error), "server_error", code=error.code)).encode() + SSE_DONE
