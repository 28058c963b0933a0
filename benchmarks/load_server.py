#!/usr/bin/env python3
"""Load-test a running tinyvllm server (or any OpenAI-compatible one, e.g. `vllm serve`) over
loopback: a fixed number of streamed completions at a bounded concurrency, then a table of
throughput and latency (and the same numbers as JSON).

    python -m tinyvllm serve --model DIR &          # in another terminal
    python benchmarks/load_server.py --num-requests 200 --concurrency 32 --max-tokens 64
    python benchmarks/load_server.py --workload mixed --num-requests 64 --concurrency 64

Bounded on purpose: it sends exactly --num-requests requests (--workload mixed: see below), never
more than --concurrency at a time, gives up after --timeout seconds, and only talks to 127.0.0.1 / ::1 / localhost (it opens
plain TCP connections itself and reads no proxy settings, so the traffic cannot leave the machine).

Time to first token (TTFT) is measured from sending the request to the first chunk with text;
inter-token latency (ITL) is the gap between consecutive text chunks, per token: a chunk that
brings k tokens after a gap g counts as k tokens g/k apart. A chunk's token count is its
`token_ids` (every request asks for them with vLLM's `return_token_ids`; a server that ignores the
field sends one chunk per engine step, one token each); the longest gap between two chunks of one
stream is reported too, undivided: that is the stall a reader sees. `ignore_eos` is set so every
request generates exactly its max_tokens and runs are comparable.

The client is meant to cost far less than the server it measures (a few µs of CPU per streamed
event): a minimal HTTP/1.1 client on asyncio protocols (keep-alive connections, chunked transfer
decoding and SSE splitting done in data_received, no task switch per read), and text chunks
recognised without json.loads (the usage chunk, errors and anything unexpected still go through
json.loads). --client-procs N splits the requests and the concurrency over N processes (forked
after the warm-up) and merges their records, for servers faster than one client core.

--workload mixed: prefill against decode, the load that shows stalls. Half the --concurrency
streams are short prompts (64-256 token ids) with 512-token outputs, --num-requests of them in
all; the other half are long prompts (2,048-4,096 token ids) with 16-32-token outputs, each
stream sending its next as soon as one ends, until the last 512-token stream has finished. So
long prefills keep arriving while the short streams decode: their ITL p99 and max, and the long
requests' TTFT, show how the server shares its steps. Reported for each class and overall.

--shared-prefix-tokens N: chat-like traffic for the prefix cache. Every prompt is then token ids
(ids in [1000, 10000), ordinary tokens of any vocabulary that large): one N-token "system
prompt" shared by all requests, then --unique-tokens ids of the request's own. The warm-up
sends the plain text prompts, so the measured run starts with nothing cached. The share of
prompt tokens the server served from its cache is read from each stream's usage chunk
(usage.prompt_tokens_details.cached_tokens, as OpenAI and vLLM report it) when it has one.

Whatever the mode, /metrics is scraped after the warm-up and again after the run: the growth of
the prefix-cache counters (tinyvllm:prefix_cache_queries_total / _hits_total, in tokens; vllm:
names are read too) is the server's own hit rate over the measured requests, the warm-up left
out. A server without those counters (or without /metrics) gets no such row."""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a paged KV cache works in two sentences.",
    "List three prime numbers greater than one hundred:",
    "Once upon a time, in a small village by the mountains,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Translate to German: The weather is nice today.",
]


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None         # from the usage chunk
    cached_tokens: int | None = None         # usage.prompt_tokens_details.cached_tokens, if sent
    inter_token_s: list[float] = field(default_factory=list)   # gaps between chunks with tokens ...
    chunk_tokens: list[int] = field(default_factory=list)      # ... and the tokens each gap brought
    kind: str | None = None                  # --workload mixed: "long" or "short"


@dataclass(frozen=True)
class MixedShape:
    """--workload mixed's two classes of request: (lowest, highest) token counts, inclusive."""
    long_prompt: tuple[int, int] = (2048, 4096)
    long_output: tuple[int, int] = (16, 32)
    short_prompt: tuple[int, int] = (64, 256)
    short_output: int = 512


MIXED = MixedShape()


class ClientError(Exception):
    """A malformed or cut-off response, or a connection that failed."""


def require_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    sys.exit(f"load_server.py: refusing to load-test {host!r}: only loopback targets "
             "(127.0.0.1, ::1, localhost) are allowed")


class HTTPResponseParser:
    """Incremental HTTP/1.1 response parser: feed() the bytes as they arrive, get back the body
    bytes they complete (chunked transfer decoded). Status line and headers first; then a
    chunked body, a Content-Length body, or (neither) a body that ends when the server closes."""

    HEAD, SIZE, DATA, DATA_END, TRAILER, LENGTH, UNTIL_CLOSE, DONE = range(8)

    def __init__(self, head_only: bool = False):
        self.buf = b""
        self.state = self.HEAD
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.remaining = 0
        self.head_only = head_only          # a response to HEAD has no body

    @property
    def done(self) -> bool:
        return self.state == self.DONE

    def _take_body(self, buf: bytes, pos: int, out: list[bytes], then: int) -> int:
        """Move up to self.remaining body bytes from buf[pos:] to out; when none remain, go to
        state `then`. Returns the new position."""
        take = min(self.remaining, len(buf) - pos)
        out.append(buf[pos:pos + take])
        self.remaining -= take
        if not self.remaining:
            self.state = then
        return pos + take

    def feed(self, data: bytes) -> list[bytes]:
        buf = self.buf + data if self.buf else data
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n:
            state = self.state
            if state == self.SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                try:
                    size = int(buf[pos:end].split(b";", 1)[0], 16)
                except ValueError:
                    raise ClientError(f"bad chunk size line {buf[pos:end][:40]!r}") from None
                pos = end + 2
                if size:
                    self.remaining, self.state = size, self.DATA
                else:
                    self.state = self.TRAILER
            elif state == self.DATA:
                pos = self._take_body(buf, pos, out, then=self.DATA_END)
            elif state == self.DATA_END:
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ClientError("chunk not followed by CRLF")
                pos += 2
                self.state = self.SIZE
            elif state == self.TRAILER:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                self.state = self.DONE if end == pos else self.TRAILER   # empty line ends it
                pos = end + 2
            elif state == self.LENGTH:
                pos = self._take_body(buf, pos, out, then=self.DONE)
            elif state == self.UNTIL_CLOSE:
                out.append(buf[pos:])
                pos = n
            elif state == self.HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                self._parse_head(buf[pos:end])
                pos = end + 4
            else:                                   # DONE: nothing may follow (no pipelining)
                raise ClientError("bytes after the end of the response")
        self.buf = buf[pos:]
        return out

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ClientError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ClientError(f"bad header line {line[:80]!r}")
            name = name.strip().lower()
            headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
        if 100 <= status < 200:                      # interim response (100 Continue): skip it
            return
        self.status, self.headers = status, headers
        connection = headers.get("connection", "").lower()
        self.keep_alive = ("close" not in connection
                           and (parts[0] != "HTTP/1.0" or "keep-alive" in connection))
        if self.head_only or status in (204, 304):
            self.state = self.DONE
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = self.SIZE
        elif "content-length" in headers:
            self.remaining = int(headers["content-length"])
            self.state = self.LENGTH if self.remaining else self.DONE
        else:
            self.state, self.keep_alive = self.UNTIL_CLOSE, False

    def eof(self) -> None:
        """The server closed the connection: the end of an UNTIL_CLOSE body, else an error."""
        if self.state == self.UNTIL_CLOSE:
            self.state = self.DONE
        elif self.state != self.DONE:
            raise ClientError("connection closed before the response was complete")


class SSEDecoder:
    """Server-sent events from body bytes: feed() returns the data of every event the bytes
    complete (an event ends at a blank line; several `data:` lines are joined with newlines;
    other fields and comments are ignored; LF, CRLF or CR line ends)."""

    def __init__(self):
        self.pending = b""
        self.data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        if self.pending:
            chunk = self.pending + chunk
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):                # maybe half of a CRLF: wait for the rest
                self.pending = chunk
                return []
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = chunk.split(b"\n")
        self.pending = lines.pop()                   # the unfinished line ("" when none)
        events = []
        data = self.data
        for line in lines:
            if not line:
                if data:
                    events.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data = self.data = []
            elif line.startswith(b"data:"):
                data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        return events


# A completions text chunk: "text": "<first char>" (json.dumps spacing, or compact). A quote can
# only stand unescaped in JSON outside strings, so these patterns never match inside a text.
_TEXT = re.compile(rb'"text": ?"(.)', re.S)
_SLOW = re.compile(rb'"error"|"usage": ?\{')
# vLLM's return_token_ids: the chunk's new tokens ("prompt_token_ids" has no quote before "token")
_TOKEN_IDS = re.compile(rb'"token_ids": ?\[([^\]]*)\]')


def chunk_token_count(payload: bytes) -> int | None:
    """The number of tokens a chunk brings, from its token_ids; None when it has none."""
    m = _TOKEN_IDS.search(payload)
    if m is None:
        return None
    ids = m.group(1).strip()
    return ids.count(b",") + 1 if ids else 0


def classify_event(payload: bytes):
    """(has_text, completion_tokens or None, error or None) of one SSE data payload, without
    json.loads for the common text chunk; usage chunks, errors and other shapes are parsed."""
    if not _SLOW.search(payload):
        m = _TEXT.search(payload)
        if m is not None:
            return m.group(1) != b'"', None, None
    chunk = json.loads(payload)
    if "error" in chunk:
        err = chunk["error"]
        return False, None, (err.get("message", "stream error") if isinstance(err, dict)
                             else str(err))
    choices = chunk.get("choices")
    has_text = bool(choices and choices[0].get("text"))
    usage = chunk.get("usage")
    return has_text, (usage["completion_tokens"] if usage else None), None


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time. The response is parsed in
    data_received; SSE data payloads go to `on_event` as they arrive (with a 200 response)."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.received = False            # any byte of the current response yet
        self.parser: HTTPResponseParser | None = None
        self.sse: SSEDecoder | None = None
        self.body: list[bytes] = []
        self.on_event = None
        self.done: asyncio.Future | None = None

    def connection_made(self, transport):
        self.transport = transport

    def start(self, request: bytes, on_event, loop) -> asyncio.Future:
        self.parser, self.sse, self.body = HTTPResponseParser(), None, []
        self.on_event, self.received = on_event, False
        self.done = loop.create_future()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes):
        if self.done is None or self.done.done():
            self.closed = True              # unexpected bytes between responses: drop it
            self.transport.close()
            return
        self.received = True
        try:
            pieces = self.parser.feed(data)
            if self.on_event is not None and self.parser.status == 200:
                sse = self.sse or SSEDecoder()
                self.sse = sse
                on_event = self.on_event
                for piece in pieces:
                    for payload in sse.feed(piece):
                        on_event(payload)
            else:
                self.body += pieces
            if self.parser.done:
                self.done.set_result(None)
        except Exception as e:               # noqa: BLE001 (ClientError, ValueError from JSON)
            self.closed = True
            self.transport.close()
            self.done.set_exception(e)

    def connection_lost(self, exc):
        self.closed = True
        if self.done is not None and not self.done.done():
            try:
                self.parser.eof()
                self.done.set_result(None)
            except ClientError as e:
                self.done.set_exception(ClientError(f"{e}: {exc}") if exc else e)


class Client:
    """A pool of keep-alive connections to one loopback host (callers bound the concurrency)."""

    def __init__(self, url: str, api_key: str | None):
        u = urlsplit(url)
        if u.scheme != "http":
            sys.exit(f"load_server.py: only http:// URLs are supported, not {url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.headers = f"Host: {host}:{self.port}\r\n" + (
            f"Authorization: Bearer {api_key}\r\n" if api_key else "")
        self.idle: list[_Connection] = []

    def build(self, method: str, path: str, body: bytes | None = None) -> bytes:
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.headers}"
        if body is None:
            return f"{head}\r\n".encode()
        return (f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                .encode() + body)

    async def request(self, request: bytes, on_event=None) -> tuple[int, dict, bytes]:
        """Send `request`, wait for the whole response: (status, headers, body). With on_event,
        a 200 response's SSE data payloads go to on_event as they arrive (the body is empty).
        A reused connection that fails before answering is retried once on a fresh one."""
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            while self.idle and self.idle[-1].closed:
                self.idle.pop()
            reused = bool(self.idle)
            conn = self.idle.pop() if reused else None
            if conn is None:
                try:
                    _, conn = await loop.create_connection(_Connection, self.host, self.port)
                except OSError as e:
                    raise ClientError(f"connect to {self.host}:{self.port}: {e}") from e
            try:
                await conn.start(request, on_event, loop)
            except ClientError:
                if reused and not conn.received and attempt == 0:
                    continue                      # the server had closed the idle connection
                raise
            except BaseException:                 # cancelled (timeout): the connection is dropped
                conn.closed = True
                conn.transport.close()
                raise
            if conn.parser.keep_alive and not conn.closed:
                self.idle.append(conn)
            else:
                conn.transport.close()
            return conn.parser.status, conn.parser.headers, b"".join(conn.body)
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in self.idle:
            conn.transport.close()
        self.idle.clear()


class _StreamRecorder:
    """Turns one stream's SSE payloads into a RequestRecord (timestamps taken on arrival)."""

    __slots__ = ("record", "start", "last", "finished", "done_at")

    def __init__(self, record: RequestRecord, start: float):
        self.record, self.start, self.last = record, start, start
        self.finished = False            # [DONE] or an error seen: ignore the rest
        self.done_at: float | None = None

    def __call__(self, payload: bytes) -> None:
        if self.finished:
            return
        if payload == b"[DONE]":
            self.finished, self.done_at = True, time.perf_counter()
            return
        has_text, completion_tokens, error = classify_event(payload)
        record = self.record
        if error is not None:
            record.error, self.finished = error, True
            return
        tokens = chunk_token_count(payload)
        if tokens is None:                       # a server that does not say: a text chunk is a token
            tokens = 1 if has_text else 0
        if tokens:
            now = time.perf_counter()
            if record.ttft_s is None:
                record.ttft_s = now - self.start
            else:
                record.inter_token_s.append(now - self.last)
                record.chunk_tokens.append(tokens)
            self.last = now
        if completion_tokens is not None:        # the usage chunk (once per stream): the rest of it
            record.completion_tokens = completion_tokens
            usage = json.loads(payload)["usage"]
            record.prompt_tokens = usage.get("prompt_tokens")
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def make_prompts(args, first: int, count: int) -> list[str | list[int]]:
    """The prompts of requests first .. first + count - 1 (made before the clock starts)."""
    n = getattr(args, "shared_prefix_tokens", 0)
    if not n:
        return [PROMPTS[i % len(PROMPTS)] for i in range(first, first + count)]
    system = random.Random(-1).choices(range(1000, 10000), k=n)
    return [system + random.Random(i).choices(range(1000, 10000), k=args.unique_tokens)
            for i in range(first, first + count)]


async def one_request(client: Client, model: str, prompt: str | list[int], args,
                      max_tokens: int | None = None, kind: str | None = None) -> RequestRecord:
    """One streamed completion of max_tokens (default --max-tokens) tokens."""
    record = RequestRecord(kind=kind)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens or args.max_tokens,
            "temperature": args.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    request = client.build("POST", "/v1/completions", json.dumps(body).encode())
    start = time.perf_counter()
    recorder = _StreamRecorder(record, start)
    try:
        status, _, text = await client.request(request, recorder)
        if status != 200:
            record.error = f"HTTP {status}: {text.decode('utf-8', 'replace')[:200]}"
            return record
        if record.error is not None:
            return record
        record.latency_s = (recorder.done_at or time.perf_counter()) - start
        record.ok = True
    except Exception as e:   # noqa: BLE001  ClientError, JSONDecodeError, a chunk of another shape
        record.error = f"{type(e).__name__}: {e}"
    return record


PREFIX_CACHE_COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total")


def parse_prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) from Prometheus text exposition: the tinyvllm: (or vllm:) prefix-cache
    counters, summed over their label sets (one per served model). None when either is absent."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace >= 0:                       # name{labels} value [timestamp]; labels may hold spaces
            name, rest = line[:brace], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        base = name.split(":", 1)[1] if name.startswith(("tinyvllm:", "vllm:")) else None
        if base in PREFIX_CACHE_COUNTERS:
            fields = rest.split()
            if not fields:
                raise ClientError(f"metrics line without a value: {line[:120]!r}")
            totals[base] = totals.get(base, 0.0) + float(fields[0])
    if len(totals) < len(PREFIX_CACHE_COUNTERS):
        return None
    return tuple(totals[name] for name in PREFIX_CACHE_COUNTERS)


async def scrape_prefix_cache(client: Client) -> tuple[float, float] | None:
    """The server's prefix-cache counters now, or None if /metrics does not give them."""
    try:
        status, _, body = await asyncio.wait_for(client.request(client.build("GET", "/metrics")), 30)
        return parse_prefix_cache_counters(body.decode("utf-8", "replace")) if status == 200 else None
    except (ClientError, asyncio.TimeoutError, ValueError):
        return None


async def _scrape_once(args) -> tuple[float, float] | None:
    client = Client(args.url, args.api_key)
    try:
        return await scrape_prefix_cache(client)
    finally:
        client.close()


def prefix_cache_over_run(before, after) -> dict | None:
    """{"queries", "hits", "hit_rate"}: the counters' growth between two scrapes (hit_rate None
    when nothing was queried); None when either scrape had no counters."""
    if before is None or after is None:
        return None
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"queries": int(queries), "hits": int(hits),
            "hit_rate": round(hits / queries, 4) if queries > 0 else None}


async def first_model(client: Client) -> str:
    try:
        status, _, body = await client.request(client.build("GET", "/v1/models"))
    except ClientError as e:
        sys.exit(f"load_server.py: GET /v1/models: {e}")
    if status != 200:
        sys.exit(f"load_server.py: GET /v1/models: HTTP {status}: {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


def mixed_request(shape: MixedShape, kind: str, key) -> tuple[list[int], int]:
    """(prompt token ids, max_tokens) of one --workload mixed request of `kind` ("long" or
    "short"), the same for the same key on every run; ids in [1000, 10000) as above."""
    rng = random.Random(f"{kind}-{key}")
    lo, hi = shape.long_prompt if kind == "long" else shape.short_prompt
    prompt = rng.choices(range(1000, 10000), k=rng.randint(lo, hi))
    return prompt, rng.randint(*shape.long_output) if kind == "long" else shape.short_output


async def _measured_mixed(args, model: str, first: int, count: int, concurrency: int):
    """--workload mixed: `count` short-prompt streams through concurrency - concurrency // 2
    slots, beside concurrency // 2 long-prompt streams that each send their next request as soon
    as one ends, until every short one has finished (then their last ones run out)."""
    shape = getattr(args, "mixed_shape", MIXED)
    client = Client(args.url, args.api_key)
    gate = asyncio.Semaphore(concurrency - concurrency // 2)
    shorts = [mixed_request(shape, "short", i) for i in range(first, first + count)]
    shorts_done = asyncio.Event()
    long_records: list[RequestRecord] = []

    async def short(i: int) -> RequestRecord:
        prompt, max_tokens = shorts[i]
        async with gate:
            return await one_request(client, model, prompt, args, max_tokens, "short")

    async def long_stream(j: int) -> None:
        for k in itertools.count():
            if shorts_done.is_set():
                return
            prompt, max_tokens = mixed_request(shape, "long", f"{first}-{j}-{k}")   # ~1 ms for 4k ids
            long_records.append(await one_request(client, model, prompt, args, max_tokens, "long"))

    try:
        short_tasks = [asyncio.ensure_future(short(i)) for i in range(count)]
        long_tasks = [asyncio.ensure_future(long_stream(j)) for j in range(concurrency // 2)]
        cpu, start = time.process_time(), time.perf_counter()
        done, pending = await asyncio.wait(short_tasks, timeout=args.timeout)
        shorts_done.set()
        left = max(args.timeout - (time.perf_counter() - start), 0.001)
        long_pending = (await asyncio.wait(long_tasks, timeout=left))[1] if long_tasks else set()
        end = time.perf_counter()
        cpu = time.process_time() - cpu
        for t in (*pending, *long_pending):
            t.cancel()
        await asyncio.gather(*pending, *long_pending, return_exceptions=True)
    finally:
        client.close()
    timed_out = f"timed out after {args.timeout:.0f}s"
    records = [t.result() for t in short_tasks if t in done]
    records += [RequestRecord(error=timed_out, kind="short") for _ in pending]
    records += long_records + [RequestRecord(error=timed_out, kind="long") for _ in long_pending]
    return records, start, end, cpu


async def _measured(args, model: str, first: int, count: int, concurrency: int):
    if getattr(args, "workload", "uniform") == "mixed":
        return await _measured_mixed(args, model, first, count, concurrency)
    client = Client(args.url, args.api_key)
    gate = asyncio.Semaphore(concurrency)
    prompts = make_prompts(args, first, count)

    async def gated(i: int) -> RequestRecord:
        async with gate:
            return await one_request(client, model, prompts[i - first], args)

    try:
        tasks = [asyncio.ensure_future(gated(i)) for i in range(first, first + count)]
        cpu, start = time.process_time(), time.perf_counter()
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        end = time.perf_counter()
        cpu = time.process_time() - cpu
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        client.close()
    records = [t.result() for t in tasks if t in done]
    records += [RequestRecord(error=f"timed out after {args.timeout:.0f}s") for _ in pending]
    return records, start, end, cpu


async def _warm_up(args):
    """-> (model, the prefix-cache counters after the warm-up)."""
    client = Client(args.url, args.api_key)
    try:
        model = args.model or await first_model(client)
        for i in range(args.warmup):         # not measured: first calls may compile / allocate
            await one_request(client, model, PROMPTS[i % len(PROMPTS)], args, args.max_tokens or 16)
        counters = await scrape_prefix_cache(client)
    finally:
        client.close()
    return model, counters


def _child(args, model: str, first: int, count: int, concurrency: int):
    return asyncio.run(_measured(args, model, first, count, concurrency))


async def _run_one_process(args):
    model, before = await _warm_up(args)
    records, start, end, cpu = await _measured(args, model, 0, args.num_requests, args.concurrency)
    return records, end - start, cpu, prefix_cache_over_run(before, await _scrape_once(args))


def run_load(args):
    """(records, elapsed seconds, client CPU seconds of the measured part, all processes, the
    server's prefix-cache counts over the measured part: prefix_cache_over_run)."""
    procs = min(getattr(args, "client_procs", 1), args.num_requests, args.concurrency)
    if procs <= 1:
        return asyncio.run(_run_one_process(args))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    model, before = asyncio.run(_warm_up(args))
    # Split requests and concurrency as evenly as possible; the clock (perf_counter, monotonic)
    # is shared by the processes, so the run lasts from the first start to the last end.
    shares = []
    first = 0
    for p in range(procs):
        count = args.num_requests // procs + (p < args.num_requests % procs)
        shares.append((first, count, args.concurrency // procs + (p < args.concurrency % procs)))
        first += count
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_child, *zip(*[(args, model, *s) for s in shares])))
    records = [r for recs, _, _, _ in results for r in recs]
    return (records, max(r[2] for r in results) - min(r[1] for r in results),
            sum(r[3] for r in results), prefix_cache_over_run(before, asyncio.run(_scrape_once(args))))


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def token_gaps(record: RequestRecord) -> list[float]:
    """One stream's inter-token latencies, per token: a chunk that brought k tokens after a gap
    of g seconds counts as k tokens g/k apart (a record without chunk counts: 1 each)."""
    counts = itertools.chain(record.chunk_tokens, itertools.repeat(1))
    return [gap / k for gap, k in zip(record.inter_token_s, counts) for _ in range(k)]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def spread(values: list[float]) -> dict:
    """p50 / p99 / max in ms (None each for no data)."""
    return {"p50": _ms(percentile(values, 50)), "p99": _ms(percentile(values, 99)),
            "max": _ms(max(values) if values else None)}


def stream_stats(records: list[RequestRecord]) -> dict:
    """The latency figures of a set of requests (all of them, or one class of the mixed load)."""
    ok = [r for r in records if r.ok]
    gaps = [g for r in ok for g in r.inter_token_s]
    latency = [r.latency_s for r in ok]
    return {"succeeded": len(ok), "failed": len(records) - len(ok),
            "output_tokens": sum(r.completion_tokens for r in ok),
            "ttft_ms": spread([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_ms": spread([x for r in ok for x in token_gaps(r)]),
            "longest_gap_ms": _ms(max(gaps) if gaps else None),
            "latency_ms": {"p50": _ms(percentile(latency, 50)), "p99": _ms(percentile(latency, 99))}}


def summarize(records: list[RequestRecord], elapsed: float, args, prefix_cache: dict | None = None) -> dict:
    overall = stream_stats(records)
    ok = [r for r in records if r.ok]
    errors = sorted({r.error for r in records if r.error})
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    prompt_tokens = sum(r.prompt_tokens for r in reported)
    tokens = overall["output_tokens"]
    mixed = getattr(args, "workload", "uniform") == "mixed"
    return {
        "url": args.url, "workload": getattr(args, "workload", "uniform"), "num_requests": len(records),
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "succeeded": overall["succeeded"],
        "failed": overall["failed"], "duration_s": round(elapsed, 3),
        "requests_per_s": round(len(ok) / elapsed, 3) if elapsed else None,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / elapsed, 1) if elapsed else None,
        **{k: overall[k] for k in ("ttft_ms", "itl_ms", "longest_gap_ms", "latency_ms")},
        # --workload mixed: the same figures for each class, and the classes' shape
        "classes": {kind: stream_stats([r for r in records if r.kind == kind]) for kind in ("long", "short")}
        if mixed else None,
        "mixed_shape": asdict(getattr(args, "mixed_shape", MIXED)) if mixed else None,
        "shared_prefix_tokens": getattr(args, "shared_prefix_tokens", 0),
        # over the requests whose usage reported cached tokens (None: the server reported none)
        "prefix_cache_hit_rate": (round(sum(r.cached_tokens for r in reported) / prompt_tokens, 4)
                                  if reported else None),
        # the server's /metrics counters over the measured run (None: it has none)
        "prefix_cache_metrics": prefix_cache,
        "errors": errors[:10],
    }


def _three(d: dict) -> str:
    return f"{d['p50']} / {d['p99']} / {d['max']}"


def print_table(s: dict) -> None:
    rows = [
        ("requests ok / sent", f"{s['succeeded']} / {s['num_requests']}"),
        ("concurrency", s["concurrency"]),
        ("duration (s)", s["duration_s"]),
        ("requests/s", s["requests_per_s"]),
        ("output tokens/s", s["output_tokens_per_s"]),
        ("TTFT p50 / p99 / max (ms)", _three(s["ttft_ms"])),
        ("ITL p50 / p99 / max (ms)", _three(s["itl_ms"])),
        ("longest gap in a stream (ms)", s["longest_gap_ms"]),
        ("latency p50 / p99 (ms)", f"{s['latency_ms']['p50']} / {s['latency_ms']['p99']}"),
    ]
    if s.get("classes"):
        shape = s["mixed_shape"]
        labels = {"long": "long prompts ({}-{} tokens, {}-{} out)".format(*shape["long_prompt"], *shape["long_output"]),
                  "short": "short prompts ({}-{} tokens, {} out)".format(*shape["short_prompt"], shape["short_output"])}
        for kind, c in s["classes"].items():
            rows += [(labels[kind], f"{c['succeeded']} ok / {c['succeeded'] + c['failed']}, "
                                    f"{c['output_tokens']:,} output tokens"),
                     ("  TTFT p50 / p99 / max (ms)", _three(c["ttft_ms"])),
                     ("  ITL p50 / p99 / max (ms)", _three(c["itl_ms"])),
                     ("  longest gap in a stream (ms)", c["longest_gap_ms"])]
    if s["shared_prefix_tokens"]:
        rate = s["prefix_cache_hit_rate"]
        rows.append(("prompt tokens from cache", "not in the server's usage" if rate is None else f"{rate:.1%}"))
    m = s.get("prefix_cache_metrics")
    if m is not None:
        rate = "no lookups" if m["hit_rate"] is None else f"{m['hit_rate']:.1%}"
        rows.append(("prefix-cache hit rate (/metrics)", f"{rate} ({m['hits']:,} / {m['queries']:,} tokens)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for e in s["errors"]:
        print(f"error: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64)")
    p.add_argument("--workload", choices=["uniform", "mixed"], default="uniform",
                   help="uniform: every request alike; mixed: long prompts with short outputs beside "
                        "short prompts with 512-token outputs (see the top of this file)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first")
    p.add_argument("--timeout", type=float, default=600.0, help="overall limit in seconds")
    p.add_argument("--out", default=None, help="write the summary as JSON here")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes to split the requests and concurrency over")
    p.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                   help="token-id prompts that all start with the same N tokens (prefix caching)")
    p.add_argument("--unique-tokens", type=int, default=64,
                   help="with --shared-prefix-tokens: each request's own tokens after it")
    args = p.parse_args(argv)
    if args.workload == "mixed":
        for bad, why in ((args.max_tokens is not None, "sets its own output lengths: drop --max-tokens"),
                         (args.shared_prefix_tokens, "has prompts of its own: drop --shared-prefix-tokens"),
                         (args.client_procs > 1, "runs in one client process: drop --client-procs"),
                         (args.concurrency < 2, "needs --concurrency >= 2 (half long, half short streams)")):
            if bad:
                p.error(f"--workload mixed {why}")
    elif args.max_tokens is None:
        args.max_tokens = 64
    if min(args.num_requests, args.concurrency, args.max_tokens or 1, args.client_procs, args.unique_tokens) < 1:
        p.error("--num-requests, --concurrency, --max-tokens, --client-procs and --unique-tokens "
                "must be >= 1")
    if args.shared_prefix_tokens < 0:
        p.error("--shared-prefix-tokens must be >= 0")
    require_loopback(args.url)

    records, elapsed, client_cpu, prefix_cache = run_load(args)
    summary = summarize(records, elapsed, args, prefix_cache)
    print_table(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in records],
                       "client": {"procs": args.client_procs, "cpu_s": round(client_cpu, 3)}},
                      f, indent=1)
        print(f"wrote {args.out}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
