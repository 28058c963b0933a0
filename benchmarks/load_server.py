#!/usr/bin/env python3
"""Load-test a running tinyvllm server over loopback: a fixed number of streamed completions at a
bounded concurrency, then a table of throughput and latency (and the same numbers as JSON).

    python -m tinyvllm serve --model DIR &          # in another terminal
    python benchmarks/load_server.py --num-requests 200 --concurrency 32 --max-tokens 64

Bounded on purpose: it sends exactly --num-requests requests, never more than --concurrency at a
time, gives up after --timeout seconds, and only talks to 127.0.0.1 / ::1 / localhost (proxies
from the environment are ignored, so the traffic cannot leave the machine).

Time to first token (TTFT) is measured from sending the request to the first chunk with text;
inter-token latency (ITL) is the gap between consecutive text chunks (one chunk = one engine
step for that request). `ignore_eos` is set so every request generates exactly --max-tokens
tokens and runs are comparable."""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

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
    inter_token_s: list[float] = field(default_factory=list)


def require_loopback(url: str) -> None:
    host = httpx.URL(url).host
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    sys.exit(f"load_server.py: refusing to load-test {host!r}: only loopback targets "
             "(127.0.0.1, ::1, localhost) are allowed")


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, args) -> RequestRecord:
    record = RequestRecord()
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "stream error")
                    return record
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.inter_token_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
        record.latency_s = time.perf_counter() - start
        record.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


async def run_load(args) -> tuple[list[RequestRecord], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout), trust_env=False) as client:
        model = args.model or (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        for i in range(args.warmup):         # not measured: first calls may compile / allocate
            await one_request(client, model, PROMPTS[i % len(PROMPTS)], args)
        gate = asyncio.Semaphore(args.concurrency)

        async def gated(i: int) -> RequestRecord:
            async with gate:
                return await one_request(client, model, PROMPTS[i % len(PROMPTS)], args)

        tasks = [asyncio.ensure_future(gated(i)) for i in range(args.num_requests)]
        start = time.perf_counter()
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        elapsed = time.perf_counter() - start
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    records = [t.result() for t in tasks if t in done]
    records += [RequestRecord(error=f"timed out after {args.timeout:.0f}s") for _ in pending]
    return records, elapsed


def summarize(records: list[RequestRecord], elapsed: float, args) -> dict:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.inter_token_s]
    latency = [r.latency_s for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    errors = sorted({r.error for r in records if r.error})
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "url": args.url, "num_requests": len(records), "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "succeeded": len(ok), "failed": len(records) - len(ok),
        "duration_s": round(elapsed, 3),
        "requests_per_s": round(len(ok) / elapsed, 3) if elapsed else None,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / elapsed, 1) if elapsed else None,
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99))},
        "itl_ms": {"p50": ms(percentile(itl, 50)), "p99": ms(percentile(itl, 99))},
        "latency_ms": {"p50": ms(percentile(latency, 50)), "p99": ms(percentile(latency, 99))},
        "errors": errors[:10],
    }


def print_table(s: dict) -> None:
    rows = [
        ("requests ok / sent", f"{s['succeeded']} / {s['num_requests']}"),
        ("concurrency", s["concurrency"]),
        ("duration (s)", s["duration_s"]),
        ("requests/s", s["requests_per_s"]),
        ("output tokens/s", s["output_tokens_per_s"]),
        ("TTFT p50 / p99 (ms)", f"{s['ttft_ms']['p50']} / {s['ttft_ms']['p99']}"),
        ("ITL p50 / p99 (ms)", f"{s['itl_ms']['p50']} / {s['itl_ms']['p99']}"),
        ("latency p50 / p99 (ms)", f"{s['latency_ms']['p50']} / {s['latency_ms']['p99']}"),
    ]
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
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first")
    p.add_argument("--timeout", type=float, default=600.0, help="overall limit in seconds")
    p.add_argument("--out", default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--num-requests, --concurrency and --max-tokens must be >= 1")
    require_loopback(args.url)

    records, elapsed = asyncio.run(run_load(args))
    summary = summarize(records, elapsed, args)
    print_table(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in records]}, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
