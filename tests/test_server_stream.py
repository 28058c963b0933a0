"""The streaming fast paths of the server, without a server: the templated SSE chunks are the
same bytes as the generic builder's, and a RequestStream hands out everything pending in order,
raising an engine failure only after the events delivered before it."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from tinyvllm.server import responses as R  # noqa: E402
from tinyvllm.server.engine_loop import EngineFailure, RequestStream, StreamEvent  # noqa: E402
from tinyvllm.server.request_stream import SampleEvent  # noqa: E402


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_encoder_matches_generic_chunks(chat, include_usage):
    ident = R.ResponseIdentity("cmpl-1", 'mo"del\0é', chat=chat)
    encode = R.StreamEncoder(ident, include_usage)
    for text in ["hello", ' "quoted"\n', "é€😀", "\0", "\\u0000", "\x1f"]:
        assert encode.text(text) == R.sse(R.chunk(ident, text, with_usage_field=include_usage)).encode()
        assert encode.event(text, "eos") == R.sse(R.chunk(ident, text, "eos",
                                                          with_usage_field=include_usage)).encode()
    assert encode.event("", first=True) == R.sse(R.chunk(ident, "", first=True,
                                                         with_usage_field=include_usage)).encode()
    assert encode.usage(3, 4) == R.sse(R.usage_chunk(ident, 3, 4)).encode()


def test_request_stream_batches_events_and_orders_failures():
    async def main():
        loop = asyncio.get_running_loop()
        stream = RequestStream("r", loop, accepted=loop.create_future())
        events = [StreamEvent((SampleEvent(0, t, i + 1, False, None),), 1, False) for i, t in enumerate("abc")]
        loop.call_soon(stream.put, events[0])
        assert await stream.next_events() == [events[0]]       # waited for it
        stream.put(events[1])
        stream.put(events[2])
        stream.put(EngineFailure("boom"))
        assert await stream.next_events() == events[1:]
        with pytest.raises(EngineFailure):
            await stream.next_events()
        assert stream.finished
        stream2 = RequestStream("s", loop, accepted=loop.create_future())
        for e in events:
            stream2.put(e)
        assert [await stream2.next_event() for _ in events] == events
    asyncio.run(asyncio.wait_for(main(), 10))
