"""From accepted request to response: submit the prompt(s) to the engine loop, then either collect
the whole text (watching for the client to hang up) or stream it as SSE.

A batch of prompts (/v1/completions with a list) becomes one engine request per prompt, all
queued at once so they share the same steps; choice i answers prompt i, in a non-streamed
response and in the streamed chunks alike, and the usage is summed."""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tinyvllm.server import responses as R
from tinyvllm.server.engine_loop import EngineFailure, EngineLoop, RequestStream

SSE_DONE = R.SSE_DONE.encode()


async def serve(engine_loop: EngineLoop, request: Request, ident: R.ResponseIdentity,
                prompts: list, params, stream: bool, include_usage: bool):
    ids = [ident.id] if len(prompts) == 1 else [f"{ident.id}-{i}" for i in range(len(prompts))]
    streams = await engine_loop.submit_all(list(zip(ids, prompts)), params)   # 400 if refused
    if stream:
        events = (_sse_events(streams[0], ident, include_usage) if len(streams) == 1
                  else _batched_sse_events(streams, ident, include_usage))
        return _EngineStreamingResponse(engine_loop, streams, events)
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
        return JSONResponse(R.error_body("client disconnected"), status_code=499)
    results = collect.result()          # re-raises EngineFailure -> 500
    bodies = [R.full_response(ident, text, last.finish_reason, last.num_prompt_tokens,
                              last.num_generated_tokens, index=i)
              for i, (text, last) in enumerate(results)]
    if len(bodies) > 1:
        bodies[0]["choices"] = [b["choices"][0] for b in bodies]
        bodies[0]["usage"] = R.usage(sum(last.num_prompt_tokens for _, last in results),
                                     sum(last.num_generated_tokens for _, last in results))
    return bodies[0]


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _collect(stream: RequestStream):
    parts = []
    while True:
        event = await stream.next_event()
        parts.append(event.delta_text)
        if event.finished:
            return "".join(parts), event


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EngineStreamingResponse(StreamingResponse):
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


async def _sse_events(stream: RequestStream, ident: R.ResponseIdentity, include_usage: bool):
    """The response body of one prompt: every event the stream has pending goes out as one body
    chunk (SSE allows several `data:` events per chunk), so a stream that fell behind the engine
    catches up in one write instead of one write per token."""
    encode = R.StreamEncoder(ident, include_usage)
    if ident.chat:   # OpenAI opens a chat stream with the role and empty content
        yield encode.event("", first=True)
    while True:
        try:
            events = await stream.next_events()
        except EngineFailure as e:
            yield _failure(e)
            return
        parts = []
        for event in events:
            if event.finished:
                parts.append(encode.event(event.delta_text, event.finish_reason))
                if include_usage:
                    parts.append(encode.usage(event.num_prompt_tokens, event.num_generated_tokens))
                parts.append(SSE_DONE)
                yield b"".join(parts)
                return
            if event.delta_text:
                parts.append(encode.text(event.delta_text))
        if parts:
            yield parts[0] if len(parts) == 1 else b"".join(parts)


async def _batched_sse_events(streams: list[RequestStream], ident: R.ResponseIdentity,
                              include_usage: bool):
    """The response body of a batch: chunks of every prompt as they come, each with its choice
    index; one usage chunk (summed) and [DONE] once every prompt has finished."""
    encoders = [R.StreamEncoder(ident, include_usage, index=i) for i in range(len(streams))]
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
                    if event.finished:
                        parts.append(encoders[i].event(event.delta_text, event.finish_reason))
                        prompt_tokens += event.num_prompt_tokens
                        completion_tokens += event.num_generated_tokens
                    elif event.delta_text:
                        parts.append(encoders[i].text(event.delta_text))
                if not streams[i].finished:
                    waiting[asyncio.ensure_future(streams[i].next_events())] = i
            if parts:
                yield b"".join(parts)
        yield (encoders[0].usage(prompt_tokens, completion_tokens) if include_usage else b"") + SSE_DONE
    finally:
        for task in waiting:
            task.cancel()


def _failure(error: EngineFailure) -> bytes:
    return R.sse(R.error_body(str(error), "server_error", code=error.code)).encode() + SSE_DONE
