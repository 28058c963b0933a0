"""One thread owns the engine; HTTP handlers talk to it through queues.

The engine is not thread-safe, and batching only happens if every request goes through the same
`step()`. So a single background thread runs

    wait until there is work -> apply queued commands (add / abort / call) -> engine.step()
    -> hand each RequestOutput to the asyncio queue of the handler that owns that request

Handlers (on the asyncio event loop) never touch the engine: they append a command under a
condition variable, which also wakes the thread when it sleeps idle (no busy spin), and read
`StreamEvent`s from their RequestStream. The engine thread hands over a whole step at once (one
loop.call_soon_threadsafe per step, never a wait on the event loop); a handler takes everything
its stream has pending in one call, so a handler that fell behind catches up in one write.

An exception inside `step()` fails the requests in flight (their handlers answer 500), is logged
with its traceback, and the loop goes on serving new requests."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from tinyvllm.errors import InvalidRequestError

log = logging.getLogger("tinyvllm.server")


class EngineFailure(RuntimeError):
    """The engine raised while serving this request (a bug, not the client's fault: HTTP 500)."""
    status, code = 500, "engine_error"


class ServerShuttingDown(EngineFailure):
    status, code = 503, "server_shutting_down"


class StreamEvent(NamedTuple):
    """A snapshot of one RequestOutput, copied in the engine thread so the handler never reads
    an object the engine may still be mutating. (A NamedTuple: immutable and cheap to build,
    one per request per step.)"""
    delta_text: str
    num_prompt_tokens: int
    num_generated_tokens: int
    finished: bool
    finish_reason: str | None


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


@dataclass
class _Command:
    kind: str                      # "add" | "abort" | "call"
    request_id: str = ""
    prompt: Any = None
    params: Any = None
    stream: RequestStream | None = None
    fn: Callable | None = None
    result: concurrent.futures.Future | None = None


def _snapshot(out) -> StreamEvent:
    return StreamEvent(out.delta_text or "", len(out.prompt_token_ids), out.num_generated_tokens,
                       bool(out.finished), out.finish_reason)


class EngineLoop:
    def __init__(self, engine):
        self.engine = engine
        self._commands: collections.deque[_Command] = collections.deque()
        self._wakeup = threading.Condition()
        self._streams: dict[str, RequestStream] = {}   # live requests; engine thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)
        self.consecutive_failures = 0
        self._closed = False

    # ---- called from the asyncio side (or any thread) ----------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is in flight, fail its handlers, join the thread, release the engine
        (GPU memory, cuBLAS handle) once nothing can touch it any more. Idempotent."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.0fs; not closing the engine", timeout)
            return
        with self._wakeup:      # stop() may race with itself (Ctrl-C timer and app shutdown)
            close, self._closed = not self._closed, True
        if close and hasattr(self.engine, "close"):
            self.engine.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def healthy(self) -> bool:
        return self.alive and self.consecutive_failures < 3

    async def submit(self, request_id: str, prompt, params) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises InvalidRequestError."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, accepted=loop.create_future())
        self._push(_Command("add", request_id, prompt, params, stream=stream))
        try:
            await stream.accepted
        except asyncio.CancelledError:   # client went away before the engine saw the request
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks. Safe to call for finished or unknown ids."""
        self._push(_Command("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread (the only safe place), e.g. to read
        engine.num_free_blocks. Await with asyncio.wrap_future or .result(timeout)."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._push(_Command("call", fn=fn, result=result))
        return result

    def _push(self, command: _Command) -> None:
        with self._wakeup:
            if not self._stopping:
                self._commands.append(command)
                self._wakeup.notify()
                return
        # The loop has stopped or is stopping: nobody will apply this command, so answer it now.
        gone = ServerShuttingDown("the server is shutting down")
        if command.kind == "add":
            self._resolve(command.stream, error=gone)
        elif command.kind == "call":
            command.result.set_exception(gone)

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        log.info("engine loop started")
        while True:
            with self._wakeup:
                while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                    self._wakeup.wait()
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            for command in commands:
                self._apply(command)
            if stopping:
                self._fail_all(ServerShuttingDown("the server is shutting down"))
                break
            if self.engine.has_unfinished_requests():
                self._step()
        # the KV figures once everything has been aborted: a leak shows as free < total
        bm = getattr(self.engine, "block_manager", None)
        log.info("engine loop stopped: %s KV blocks free of %s, %s preemptions",
                 getattr(bm, "num_free_blocks", "?"), getattr(bm, "num_blocks", "?"),
                 getattr(self.engine, "num_preemptions", "?"))

    def _apply(self, c: _Command) -> None:
        if c.kind == "add":
            try:
                self.engine.add_request(c.request_id, c.prompt, c.params)
            except InvalidRequestError as e:
                self._resolve(c.stream, error=e)
            except Exception as e:  # a bug in add_request: fail this request, keep serving
                log.exception("add_request(%s) failed", c.request_id)
                self._resolve(c.stream, error=EngineFailure(f"engine error: {e!r}"))
            else:
                self._streams[c.request_id] = c.stream
                self._resolve(c.stream)
        elif c.kind == "abort":
            if self._streams.pop(c.request_id, None) is not None:
                try:
                    self.engine.abort_request(c.request_id)
                except Exception:
                    log.exception("abort_request(%s) failed", c.request_id)
        elif c.kind == "call":
            try:
                c.result.set_result(c.fn(self.engine))
            except Exception as e:
                c.result.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.consecutive_failures += 1
            log.exception("engine.step() failed; failing the %d requests in flight",
                          len(self._streams))
            self._fail_all(EngineFailure(f"engine error: {e!r}"))
            # An engine that fails every step must not turn this loop into a log-flooding spin.
            time.sleep(min(5.0, 0.01 * 2 ** self.consecutive_failures))
            return
        self.consecutive_failures = 0
        deliveries = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:        # aborted by its client since this step was scheduled
                continue
            event = _snapshot(out)
            if event.finished:
                del self._streams[out.request_id]
            deliveries.append((stream, event))
        self._deliver(deliveries)

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        for request_id in streams:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort_request(%s) failed while failing requests", request_id)
        self._deliver([(s, error) for s in streams.values()])

    # One call_soon_threadsafe per event loop per step, not one per token: with 100 streams that
    # is the difference between 1 and 100 wake-ups of the event loop.
    def _deliver(self, deliveries: list[tuple[RequestStream, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:      # that event loop is closed: nobody is listening any more
                pass

    @staticmethod
    def _resolve(stream: RequestStream, error: Exception | None = None) -> None:
        def settle():
            if stream.accepted.done():    # the handler was cancelled meanwhile
                return
            if error is None:
                stream.accepted.set_result(None)
            else:
                stream.accepted.set_exception(error)
        try:
            stream.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass


def _put_all(batch) -> None:
    for stream, item in batch:
        stream.put(item)
