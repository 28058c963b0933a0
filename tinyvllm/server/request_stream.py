"""The handler's side of the engine loop: RequestStream (one request's events, read on the event
loop), the StreamEvent snapshots it carries, and the failures it can raise."""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import NamedTuple


class EngineFailure(RuntimeError):
    """The engine raised while serving this request (a bug, not the client's fault: HTTP 500)."""
    status, code = 500, "engine_error"


class ServerShuttingDown(EngineFailure):
    status, code = 503, "server_shutting_down"


class SampleEvent(NamedTuple):
    """What is new in one sample (CompletionOutput) of a request since its previous event."""
    index: int
    delta_text: str
    num_generated_tokens: int
    finished: bool
    finish_reason: str | None
    delta_token_ids: list | None = None      # with logprobs only: the new tokens ...
    delta_logprobs: list | None = None       # ... and their {token id: Logprob} entries


class StreamEvent(NamedTuple):
    """A snapshot of one RequestOutput, copied in the engine thread so the handler never reads
    an object the engine may still be mutating: its samples with something new. (NamedTuples:
    immutable and cheap to build, one per request per step.)"""
    samples: tuple[SampleEvent, ...]
    num_prompt_tokens: int
    finished: bool                           # every sample has finished
    prompt_logprobs: list | None = None      # SamplingParams.prompt_logprobs (echo + logprobs)
    prompt_token_ids: list | None = None


def snapshot(out) -> StreamEvent:
    """The StreamEvent of a RequestOutput (engine thread)."""
    samples = []
    for o in out.outputs:
        if not o.is_new:
            continue
        lps = o.delta_logprobs
        samples.append(SampleEvent(o.index, o.delta_text or "", o.num_generated_tokens, o.finished,
                                   o.finish_reason, None if lps is None else o.delta_token_ids, lps))
    return StreamEvent(tuple(samples), len(out.prompt_token_ids), bool(out.finished), out.prompt_logprobs,
                       out.prompt_token_ids)


@dataclass
class RequestStream:
    """The handler's end of one request. `accepted` resolves once add_request has run (or holds
    its InvalidRequestError); then StreamEvents, or an EngineFailure, arrive in `pending`
    (appended on the event loop by _put_all, never by the engine thread)."""
    request_id: str
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future
    pending: collections.deque = field(default_factory=collections.deque)
    finished: bool = False
    _waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        """Event loop thread only."""
        self.pending.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        while not self.pending:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def next_event(self) -> StreamEvent:
        """The oldest event not yet read (waits if none); raises an EngineFailure in its turn."""
        await self._wait()
        item = self.pending.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def next_events(self) -> list[StreamEvent]:
        """Every event delivered and not yet read, oldest first (at least one; waits if none).
        An EngineFailure is raised once the events before it have been returned."""
        await self._wait()
        pending = self.pending
        if isinstance(pending[0], BaseException):
            self.finished = True
            raise pending.popleft()
        events = []
        while pending and not isinstance(pending[0], BaseException):
            events.append(pending.popleft())
        self.finished = events[-1].finished
        return events
