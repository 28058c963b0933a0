"""benchmarks/load_server.py's own HTTP/1.1 client: chunked transfer decoding and SSE splitting
in any byte split, text chunks recognised without json.loads exactly as json.loads would, and
a whole run against a small loopback server (keep-alive reuse, a cut connection, an error
event). CPU only, no engine."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import pathlib
import sys
import types

import pytest

from tinyvllm.server import responses as R

_path = pathlib.Path(__file__).parent.parent / "benchmarks" / "load_server.py"
_spec = importlib.util.spec_from_file_location("load_server", _path)
L = sys.modules["load_server"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(L)


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x;ext=1\r\n" % len(p) + p + b"\r\n" if i % 2 else b"%X\r\n" % len(p) + p + b"\r\n"
                    for i, p in enumerate(pieces))
    return body + b"0\r\nX-Trailer: 1\r\n\r\n"


def feed_split(data: bytes, sizes) -> tuple[L.HTTPResponseParser, list[bytes]]:
    parser, sse, events = L.HTTPResponseParser(), L.SSEDecoder(), []
    pos, i = 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        for piece in parser.feed(data[pos:pos + n]):
            events += sse.feed(piece)
        pos, i = pos + n, i + 1
    return parser, events


@pytest.mark.parametrize("sizes", [[1], [2, 3], [7], [64], [1 << 20]])
def test_chunked_sse_any_split(sizes):
    payloads = [json.dumps({"i": i, "text": "a\nb" * i}).encode() for i in range(20)]
    sse_bytes = b"".join(b"data: " + p + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"
    # HTTP chunk boundaries that do not line up with the SSE events
    cuts = [0, 5, 6, 40, 41, 300, len(sse_bytes)]
    body = chunked(*[sse_bytes[a:b] for a, b in zip(cuts, cuts[1:]) if b > a])
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    parser, events = feed_split(head + body, sizes)
    assert parser.done and parser.status == 200 and parser.keep_alive
    assert events == payloads + [b"[DONE]"]


def test_sse_fields_crlf_multiline_and_comments():
    sse = L.SSEDecoder()
    raw = b": comment\r\nevent: x\r\ndata:a\r\ndata: b\r\n\r\nid: 3\ndata: c\r\rdata: d\n"
    events = [e for i in range(len(raw)) for e in sse.feed(raw[i:i + 1])]
    assert events == [b"a\nb", b"c"]
    assert sse.feed(b"\n") == [b"d"]


def test_content_length_until_close_and_errors():
    p = L.HTTPResponseParser()
    assert p.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n"
                  b"Connection: close\r\n\r\nab") == [b"ab"]
    assert not p.done and p.feed(b"cde") == [b"cde"] and p.done
    assert p.status == 404 and not p.keep_alive
    p = L.HTTPResponseParser()
    assert p.feed(b"HTTP/1.0 200 OK\r\n\r\nxyz") == [b"xyz"]
    p.eof()
    assert p.done
    p = L.HTTPResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")
    with pytest.raises(L.ClientError):
        p.eof()                                   # cut off mid-chunk
    with pytest.raises(L.ClientError):
        L.HTTPResponseParser().feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    with pytest.raises(L.ClientError):
        L.HTTPResponseParser().feed(b"garbage\r\n\r\n")


TEXTS = ["a", " the", '"', '"text": ""', '\\', '\\"', "\n", "é😀", '"usage": {', '"error"', "\0"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_classify_event_matches_json_loads(include_usage):
    ident = R.ResponseIdentity("cmpl-1", "tiny", chat=False)
    enc = R.StreamEncoder(ident, include_usage)
    cases = [enc.text(t) for t in TEXTS] + [enc.event(t, "length") for t in ["", *TEXTS]]
    cases += [enc.usage(3, 7), R.sse(R.error_body("boom", "server_error")).encode()]
    # compact JSON (another server's spacing) and an unexpected shape take the same answers
    cases += [R.sse(json.dumps(R.chunk(ident, t), separators=(",", ":"))).encode() for t in TEXTS]
    cases += [b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n']
    for raw in cases:
        (payload,) = L.SSEDecoder().feed(raw)
        chunk = json.loads(payload)
        expected = (bool(chunk.get("choices") and chunk["choices"][0].get("text")),
                    chunk["usage"]["completion_tokens"] if chunk.get("usage") else None,
                    chunk["error"]["message"] if "error" in chunk else None)
        if expected[2]:
            expected = (False, None, expected[2])
        assert L.classify_event(payload) == expected, raw


class FakeServer:
    """A loopback server that answers every request on a connection with a scripted response."""

    def __init__(self, responses):
        self.responses, self.connections, self.requests = responses, 0, []

    async def handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length")), b"0"))
                body = await reader.readexactly(length)
                self.requests.append((head.split(b" ")[1].decode(), body))
                response = self.responses(head, body)
                for part in response if isinstance(response, list) else [response]:
                    writer.write(part)
                    await writer.drain()
                if response is CUT:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


CUT = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"6\r\ndata: "]


def stream_response(n_tokens: int, error: bool = False) -> list[bytes]:
    enc = R.StreamEncoder(R.ResponseIdentity("cmpl-1", "tiny", chat=False), True)
    events = [enc.text(f" t{i}") for i in range(n_tokens - 1)] + [enc.event("!", "length")]
    events += [enc.usage(5, n_tokens), R.SSE_DONE.encode()]
    if error:
        events = events[:2] + [R.sse(R.error_body("engine fell over", "server_error")).encode(),
                               R.SSE_DONE.encode()]
    return [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            *[b"%x\r\n%s\r\n" % (len(e), e) for e in events], b"0\r\n\r\n"]


def run_against(responses, **kw):
    async def go():
        fake = FakeServer(responses)
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        args = types.SimpleNamespace(url=f"http://127.0.0.1:{port}", api_key="k", model=None,
                                     num_requests=kw.get("n", 6), concurrency=kw.get("concurrency", 2),
                                     max_tokens=kw.get("max_tokens", 4), temperature=0.0, warmup=1,
                                     timeout=20.0, client_procs=1, shared_prefix_tokens=kw.get("shared", 0),
                                     unique_tokens=5, workload=kw.get("workload", "uniform"),
                                     mixed_shape=kw.get("shape", L.MIXED))
        try:
            records, elapsed, _, prefix_cache = await L._run_one_process(args)
        finally:
            server.close()
        return fake, records, L.summarize(records, elapsed, args, prefix_cache)
    return asyncio.run(go())


def test_run_against_a_loopback_server_reuses_connections():
    def respond(head, body):
        if head.startswith(b"GET /v1/models"):
            data = json.dumps({"data": [{"id": "tiny"}]}).encode()
            return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data)
        if head.startswith(b"GET /metrics"):
            return b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
        request = json.loads(body)
        assert b"Authorization: Bearer k" in head and request["model"] == "tiny"
        assert request["return_token_ids"] is True and request["ignore_eos"] is True
        return stream_response(4)
    fake, records, s = run_against(respond)
    assert all(r.ok and r.completion_tokens == 4 and len(r.inter_token_s) == 3 for r in records)
    assert s["succeeded"] == 6 and s["output_tokens"] == 24 and not s["errors"]
    assert s["prefix_cache_metrics"] is None     # a server without /metrics: no hit rate
    # warm-up connection (its /metrics scrape too) + at most 2 in flight + the closing scrape
    assert fake.connections <= 4


def test_run_reports_http_errors_cut_streams_and_error_events():
    calls = []

    def respond(head, body):
        calls.append(head)
        if head.startswith(b"GET"):
            return b"HTTP/1.1 200 OK\r\ncontent-length: 26\r\n\r\n" + b'{"data": [{"id": "tiny"}]}'
        k = len(calls)
        if k % 3 == 0:
            return b"HTTP/1.1 400 Bad Request\r\ncontent-length: 3\r\n\r\nbad"
        return CUT if k % 3 == 1 else stream_response(4, error=True)
    _, records, s = run_against(respond, n=6)
    assert s["succeeded"] == 0 and s["failed"] == 6
    errors = " | ".join(s["errors"])
    assert "HTTP 400: bad" in errors and "engine fell over" in errors and "ClientError" in errors


def test_shared_prefix_mode_sends_token_prompts_and_reads_the_cached_share():
    """--shared-prefix-tokens: every measured prompt starts with the same ids and differs after;
    the warm-up stays text; the cached share comes from usage.prompt_tokens_details."""
    ident = R.ResponseIdentity("cmpl-1", "tiny", chat=False)

    scrapes = []

    def respond(head, body):
        if head.startswith(b"GET /metrics"):       # counters that grow by what the requests did
            scrapes.append(head)
            queries, hits = 1000 + (len(scrapes) - 1) * 4 * 13, 300 + (len(scrapes) - 1) * 4 * 8
            text = metrics_text({"tinyvllm:prefix_cache_queries_total": queries,
                                 "tinyvllm:prefix_cache_hits_total": hits})
            return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)
        if head.startswith(b"GET"):
            return b"HTTP/1.1 200 OK\r\ncontent-length: 26\r\n\r\n" + b'{"data": [{"id": "tiny"}]}'
        prompt = json.loads(body)["prompt"]
        cached = 8 if isinstance(prompt, list) else 0
        usage = {**R.usage_chunk(ident, 13, 2),
                 "usage": {**R.usage(13, 2), "prompt_tokens_details": {"cached_tokens": cached}}}
        enc = R.StreamEncoder(ident, True)
        events = [enc.text("a"), enc.event("b", "length"), R.sse(usage).encode(), R.SSE_DONE.encode()]
        return [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                *[b"%x\r\n%s\r\n" % (len(e), e) for e in events], b"0\r\n\r\n"]
    fake, records, s = run_against(respond, n=4, shared=8)
    prompts = [json.loads(body)["prompt"] for path, body in fake.requests if path == "/v1/completions"]
    warm, measured = prompts[0], prompts[1:]
    assert isinstance(warm, str) and len(measured) == 4
    assert all(len(p) == 8 + 5 and p[:8] == measured[0][:8] for p in measured)
    assert len({tuple(p[8:]) for p in measured}) == 4
    assert all(r.ok and r.prompt_tokens == 13 and r.cached_tokens == 8 for r in records)
    assert s["shared_prefix_tokens"] == 8 and s["prefix_cache_hit_rate"] == round(8 / 13, 4)
    # scraped after the warm-up and after the run: only the measured requests' growth counts
    assert len(scrapes) == 2
    assert s["prefix_cache_metrics"] == {"queries": 4 * 13, "hits": 4 * 8, "hit_rate": round(8 / 13, 4)}


def metrics_text(values: dict[str, float], model="tiny") -> bytes:
    lines = []
    for name, value in values.items():
        lines += [f"# HELP {name} Prefix cache counter.", f"# TYPE {name} counter",
                  f'{name}{{model_name="{model}"}} {float(value)}']
    return ("\n".join(lines) + "\n").encode()


def test_parse_prefix_cache_counters():
    """The counters summed over label sets (label values may hold spaces and braces), vllm:
    names read like tinyvllm: ones, a timestamp after the value ignored, other series and
    _created samples left alone; None when either counter is missing."""
    text = "\n".join([
        "# HELP tinyvllm:prefix_cache_hits_total Prefix cache hits.",
        "# TYPE tinyvllm:prefix_cache_hits_total counter",
        'tinyvllm:prefix_cache_hits_total{model_name="a b {c}"} 40.0',
        'tinyvllm:prefix_cache_hits_total{model_name="d"} 2.0 1700000000000',
        'tinyvllm:prefix_cache_hits_created{model_name="d"} 1.7e9',
        'tinyvllm:prefix_cache_queries_total{model_name="a b {c}"} 100.0',
        "tinyvllm:prefix_cache_queries_total 28",
        'tinyvllm:prompt_tokens_total{model_name="d"} 999.0',
    ])
    assert L.parse_prefix_cache_counters(text) == (128.0, 42.0)
    vllm = metrics_text({"vllm:prefix_cache_queries_total": 10, "vllm:prefix_cache_hits_total": 5}).decode()
    assert L.parse_prefix_cache_counters(vllm) == (10.0, 5.0)
    assert L.parse_prefix_cache_counters(text.replace("queries", "misses")) is None
    assert L.parse_prefix_cache_counters("") is None
    assert L.prefix_cache_over_run((10.0, 5.0), (30.0, 20.0)) == {"queries": 20, "hits": 15, "hit_rate": 0.75}
    assert L.prefix_cache_over_run((10.0, 5.0), (10.0, 5.0))["hit_rate"] is None
    assert L.prefix_cache_over_run(None, (10.0, 5.0)) is None


def test_chunk_token_count_reads_token_ids_not_prompt_token_ids():
    assert L.chunk_token_count(b'{"choices":[{"text":"abc","token_ids":[5,6,7]}]}') == 3
    assert L.chunk_token_count(b'{"choices": [{"text": "a", "token_ids": [5]}]}') == 1
    assert L.chunk_token_count(b'{"choices":[{"text":"","token_ids":[]}]}') == 0
    assert L.chunk_token_count(b'{"choices":[{"text":"a","prompt_token_ids":[1,2,3]}]}') is None
    assert L.chunk_token_count(b'{"choices":[{"text":"a","prompt_token_ids":[1,2],"token_ids":[9,8]}]}') == 2
    assert L.chunk_token_count(b'{"choices":[{"text":"a","token_ids":null}]}') is None
    assert L.chunk_token_count(b'{"choices":[{"text":"a"}]}') is None


def test_inter_token_latency_counts_each_chunks_tokens(monkeypatch):
    """A chunk that brings k tokens after a gap g is k tokens g/k apart; the gap itself is the
    longest wait; chunks with no tokens do not count; a chunk without token_ids is one token."""
    clock = iter([0.1, 0.4, 0.5, 0.6])
    monkeypatch.setattr(L, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    record = L.RequestRecord()
    recorder = L._StreamRecorder(record, start=0.0)
    for payload in [b'{"choices":[{"text":"a","prompt_token_ids":[1,2,3,4],"token_ids":[5]}]}',   # at 0.1
                    b'{"choices":[{"text":"bcd","token_ids":[6,7,8]}]}',                            # at 0.4
                    b'{"choices":[{"text":"","token_ids":[]}]}',
                    b'{"choices":[{"text":"e"}]}',                                                   # at 0.5
                    b'{"choices":[{"text":""}]}',
                    b'{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":5,"total_tokens":9}}',
                    b"[DONE]"]:                                                                      # at 0.6
        recorder(payload)
    assert record.ttft_s == 0.1 and recorder.done_at == 0.6 and record.completion_tokens == 5
    assert record.inter_token_s == pytest.approx([0.3, 0.1]) and record.chunk_tokens == [3, 1]
    assert L.token_gaps(record) == pytest.approx([0.1] * 4)
    record.ok, record.latency_s = True, 0.6
    stats = L.stream_stats([record, L.RequestRecord(error="boom")])
    assert stats["succeeded"] == 1 and stats["failed"] == 1 and stats["output_tokens"] == 5
    assert stats["itl_ms"] == {"p50": 100.0, "p99": 100.0, "max": 100.0} and stats["longest_gap_ms"] == 300.0
    assert stats["ttft_ms"] == {"p50": 100.0, "p99": 100.0, "max": 100.0}


def test_latency_spread_over_streams():
    """p50 / p99 / max over the per-token gaps of every stream, against a direct computation."""
    a = L.RequestRecord(ok=True, ttft_s=0.05, latency_s=1.0, inter_token_s=[0.01] * 98 + [0.5],
                        chunk_tokens=[1] * 98 + [5])
    b = L.RequestRecord(ok=True, ttft_s=0.2, latency_s=2.0, inter_token_s=[0.02] * 50, chunk_tokens=[1] * 50)
    stats = L.stream_stats([a, b])
    per_token = sorted([0.01] * 98 + [0.1] * 5 + [0.02] * 50)
    assert len(L.token_gaps(a)) == 103
    pos = 0.99 * (len(per_token) - 1)                      # linear interpolation between neighbours
    p99 = per_token[int(pos)] + (per_token[int(pos) + 1] - per_token[int(pos)]) * (pos % 1)
    assert stats["itl_ms"]["p50"] == round(per_token[len(per_token) // 2] * 1000, 2)
    assert stats["itl_ms"]["p99"] == pytest.approx(round(p99 * 1000, 2))
    assert stats["itl_ms"]["max"] == 100.0 and stats["longest_gap_ms"] == 500.0
    assert stats["ttft_ms"]["max"] == 200.0 and stats["latency_ms"]["p50"] == 1500.0


def test_mixed_workload_runs_long_prompts_beside_short_streams():
    """--workload mixed: the short streams are --num-requests token-id prompts with the long
    output; half the concurrency sends long prompts with short outputs back to back until the
    short streams are done; each class has its own figures."""
    shape = L.MixedShape(long_prompt=(30, 40), long_output=(2, 3), short_prompt=(5, 8), short_output=6)

    def respond(head, body):
        if head.startswith(b"GET"):
            return b"HTTP/1.1 200 OK\r\ncontent-length: 26\r\n\r\n" + b'{"data": [{"id": "tiny"}]}'
        return stream_response(json.loads(body)["max_tokens"])
    fake, records, s = run_against(respond, n=4, concurrency=4, workload="mixed", shape=shape, max_tokens=None)
    bodies = [json.loads(body) for path, body in fake.requests if path == "/v1/completions"]
    warm, measured = bodies[0], bodies[1:]
    assert isinstance(warm["prompt"], str) and warm["max_tokens"] == 16
    short = [b for b in measured if b["max_tokens"] == 6]
    long = [b for b in measured if b["max_tokens"] != 6]
    assert len(short) == 4 and all(5 <= len(b["prompt"]) <= 8 for b in short)
    assert len(long) >= 2 and all(30 <= len(b["prompt"]) <= 40 and 2 <= b["max_tokens"] <= 3 for b in long)
    assert len({tuple(b["prompt"]) for b in long}) == len(long)              # no two alike: no cache hits
    assert sorted(r.kind for r in records) == ["long"] * len(long) + ["short"] * 4
    assert all(r.ok for r in records) and s["succeeded"] == len(records) == s["num_requests"]
    assert s["classes"]["short"]["succeeded"] == 4 and s["classes"]["short"]["output_tokens"] == 24
    assert s["classes"]["long"]["output_tokens"] == sum(b["max_tokens"] for b in long)
    assert s["output_tokens"] == 24 + s["classes"]["long"]["output_tokens"]
    assert s["workload"] == "mixed" and s["mixed_shape"]["short_output"] == 6
    assert s["classes"]["short"]["itl_ms"]["max"] is not None


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "5"], "sets its own output lengths"),
    (["--shared-prefix-tokens", "8"], "has prompts of its own"),
    (["--client-procs", "2"], "runs in one client process"),
    (["--concurrency", "1"], "needs --concurrency >= 2"),
])
def test_mixed_workload_argument_errors(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        L.main(["--workload", "mixed", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
