"""One thread owns the engine; HTTP handlers talk to it through queues.

The engine is not thread-safe, and batching only happens if every request goes through the same
`step()`. So a single background thread runs

    wait until there is work -> apply queued commands (add / abort / call) -> engine.step()
    -> hand each RequestOutput to the asyncio queue of the handler that owns that request

A step's outputs are handed over from inside the NEXT engine.step(), right after it has launched
its step (its after_launch hook), or before the thread sleeps idle: the event loop, woken by
them, then writes its streams while the device computes, instead of holding the GIL while the
engine thread schedules and launches (benchmarks/server_overhead.py, perf-notes: the GPU's idle
time a step sat there).

Handlers (on the asyncio event loop) never touch the engine: they append a command under a
condition variable, which also wakes the thread when it sleeps idle (no busy spin), and read
`StreamEvent`s from their RequestStream. The engine thread hands over a whole step at once (one
loop.call_soon_threadsafe per step, never a wait on the event loop); a handler takes everything
its stream has pending in one call, so a handler that fell behind catches up in one write.

An exception inside `step()` fails the requests in flight (their handlers answer 500), is logged
with its traceback, and the loop goes on serving new requests.

Statistics: the engine thread appends each step's StepStats (engine/stats.py) to a queue, and
nothing more; drain_stats(), on the event loop, hands them to the listeners (the Prometheus
metrics, the periodic stats line)."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from tinyvllm.errors import EngineDeadError, InvalidRequestError
from tinyvllm.server.request_stream import (
    EngineFailure,
    RequestStream,
    ServerShuttingDown,
    StreamEvent,
    snapshot,
)

log = logging.getLogger("tinyvllm.server")


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
    return snapshot(out)


class EngineLoop:
    def __init__(self, engine):
        self.engine = engine
        self.stats_listeners: tuple[Callable[[Any], None], ...] = ()
        self._stats: collections.deque = collections.deque()   # StepStats not yet drained
        self._commands: collections.deque[_Command] = collections.deque()
        self._wakeup = threading.Condition()
        self._streams: dict[str, RequestStream] = {}   # live requests; engine thread only
        self._held: list = []     # the last step's RequestOutputs, handed over after the next launch
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)
        self.consecutive_failures = 0
        self._closed = False
        self.dead: str | None = None                       # why the engine died, once it has
        self.on_dead: Callable[[str], None] | None = None  # the server's "exit non-zero" hook

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
        return self.alive and self.dead is None and self.consecutive_failures < 3

    async def submit(self, request_id: str, prompt, params) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises InvalidRequestError."""
        return (await self.submit_all([(request_id, prompt)], params))[0]

    async def submit_all(self, requests: list[tuple[str, Any]], params) -> list[RequestStream]:
        """Queue (request_id, prompt) pairs together, so that they share the engine's next step;
        returns once the engine accepted all. If it refuses one (its InvalidRequestError is
        raised) or the caller is cancelled, none of them runs."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(rid, loop, accepted=loop.create_future()) for rid, _ in requests]
        with self._wakeup:
            stopping = self._stopping
            if not stopping:
                self._commands.extend(_Command("add", s.request_id, prompt, params, stream=s)
                                      for s, (_, prompt) in zip(streams, requests))
                self._wakeup.notify()
        if stopping:
            raise ServerShuttingDown("the server is shutting down")
        try:
            outcomes = await asyncio.gather(*(s.accepted for s in streams), return_exceptions=True)
        except asyncio.CancelledError:   # client went away before the engine saw the requests
            for s in streams:
                self.abort(s.request_id)
            raise
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            for s in streams:
                self.abort(s.request_id)
            raise failed
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks. Safe to call for finished or unknown ids."""
        self._push(_Command("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread (the only safe place), e.g. to read
        engine.num_free_blocks. Await with asyncio.wrap_future or .result(timeout)."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._push(_Command("call", fn=fn, result=result))
        return result

    def add_stats_listener(self, listener: Callable[[Any], None]) -> None:
        """Have drain_stats() hand every step's StepStats to listener. Before start()."""
        self.engine.enable_stats()
        self.stats_listeners += (listener,)

    def drain_stats(self) -> int:
        """Hand every StepStats queued so far to the listeners, oldest first (one thread at a
        time: the event loop). -> how many."""
        n, queue, listeners = 0, self._stats, self.stats_listeners
        while queue:
            stats = queue.popleft()
            for listener in listeners:
                listener(stats)
            n += 1
        return n

    def _push(self, command: _Command) -> None:
        with self._wakeup:
            if not self._stopping:
                self._commands.append(command)
                self._wakeup.notify()
                return
        # The loop has stopped or is stopping: nobody will apply this command, so answer it now.
        if command.kind == "call":
            command.result.set_exception(ServerShuttingDown("the server is shutting down"))

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        log.info("engine loop started")
        while True:
            if self._held and not self.engine.has_unfinished_requests():
                self._deliver_held()          # no next launch to wait for
            with self._wakeup:
                while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                    self._wakeup.wait()
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            for command in commands:
                self._apply(command)
            if stopping:
                self._deliver_held()
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
            outputs = self.engine.step(after_launch=self._deliver_held)
        except EngineDeadError as e:
            self._deliver_held()      # the step before's outputs are whole
            # The engine cannot run another step (a CUDA error: the context is lost). Fail
            # everything in flight now, refuse what comes next, turn /health red and ask the
            # server to exit non-zero so that a supervisor restarts it: never a half-working server.
            self.dead = str(e)
            log.error("%s; failing the %d requests in flight and stopping the server",
                      e, len(self._streams))
            self._fail_all(EngineFailure(str(e)))
            with self._wakeup:
                self._stopping = True
            if self.on_dead is not None:
                self.on_dead(self.dead)
            return
        except Exception as e:
            self._deliver_held()
            self.consecutive_failures += 1
            log.exception("engine.step() failed; failing the %d requests in flight",
                          len(self._streams))
            self._fail_all(EngineFailure(f"engine error: {e!r}"))
            # An engine that fails every step must not turn this loop into a log-flooding spin.
            time.sleep(min(5.0, 0.01 * 2 ** self.consecutive_failures))
            return
        self.consecutive_failures = 0
        if self.stats_listeners:     # before delivery: a client that saw its answer finds it counted
            self._stats.append(self.engine.last_step_stats)
        self._held = outputs

    def _deliver_held(self) -> None:
        held, self._held = self._held, []
        self._deliver_outputs(held)

    def _deliver_outputs(self, outputs) -> None:
        """Snapshot a step's RequestOutputs and hand them to their streams' handlers at once; a
        finished request's stream is forgotten here."""
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
