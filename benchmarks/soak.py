#!/usr/bin/env python3
"""Soak test: a real `python -m tinyvllm serve` (started here, on 127.0.0.1, with a KV cache small
enough to force preemptions) under a bounded mix of requests, then one report.

    python benchmarks/soak.py --quick                                  # CI-sized, numpy backend
    python benchmarks/soak.py --device cuda --preset llama-3.2-1b      # 1,000 requests at 64
    python benchmarks/soak.py --device cuda --model DIR                # any HF Llama directory

The mix (seeded): greedy completions, streamed or not; greedy chat; seeded sampling; requests the
client abandons (a timeout on a non-streamed request, a disconnect mid-stream); a few bad ones
(invalid values, a huge prompt, malformed JSON) that must get a 4xx. Before the server starts,
the same greedy / seeded requests run offline (LLM.generate, same engine options); every
completed one must give the same text. On the GPU, bf16 arithmetic and batch-dependent GEMM
shapes may flip a greedy pick where the top two logits nearly tie: a mismatch is "explained"
when the fp32 numpy reference's top-2 gap at the first differing token is under twice the bf16
numpy twin's largest logit error on this model (measured on the first mismatching sequences:
NOISE_RATIO); on the numpy backend every mismatch counts.

Reported: completed / failed / aborted (by the client) / refused counts, mismatches, preemptions and KV
blocks left in use (from the server's "engine loop stopped" log line, once it shut down after
the run: every block must be free), server RSS after warm-up and after the run, and /health
latency while the soak runs (polled every 100 ms). Exit status 1 when anything failed.
Bounded: exactly --num-requests requests, at most --concurrency at once, --timeout overall;
it only ever talks to the server it started, on loopback (httpx with trust_env=False)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

SENTENCES = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
             "Explain how a paged KV cache works.", "Once upon a time, in a small village,",
             "List three prime numbers:", "Translate to German: good morning", "The three laws are"]
HUGE_PROMPT_BYTES = [0]  # the longest prompt text the server admits, from the offline engine
# a greedy mismatch is explained where the fp32 top-2 gap is under NOISE_RATIO times the largest
# logit error of the bf16 numpy twin (round_bf16=True: bf16 where the GPU stores it) on the first
# NOISE_SAMPLES mismatching sequences: the floor of any bf16 engine on this model, measured, as
# tests/test_gpu_model.py's STEP_NOISE_RATIO (a random-weight 1B model's is ~1.1 logits, SmolLM2's far less)
NOISE_RATIO, NOISE_SAMPLES = 2.0, 3
BAD_BODIES = [           # (description, body or raw bytes): each must get a 4xx
    ("temperature -1", {"temperature": -1}), ("top_p 0", {"top_p": 0}), ("max_tokens 0", {"max_tokens": 0}),
    ("top_k 2**31", {"top_k": 2**31}), ("seed -1", {"seed": -1}), ("n 0", {"n": 0}),
    ("stop_token_ids -5", {"stop_token_ids": [-5]}), ("unknown model", {"model": "nope"}),
    ("token id past the vocabulary", {"prompt": [10**9]}), ("empty prompt", {"prompt": ""}),
    ("lone surrogate", b'{"model": "soak", "prompt": "\\ud800", "max_tokens": 4}'),
    ("malformed JSON", b'{"model": "soak", "prompt": '),
    ("body not an object", b"[1, 2, 3]"),
]


@dataclass(frozen=True)
class Spec:
    kind: str                 # text | text_stream | chat | chat_stream | seeded | abandon | disconnect | bad | huge
    index: int                # into the prompt pool (or BAD_BODIES for "bad")
    max_tokens: int = 8
    seed: int = 0
    delay_s: float = 0.0      # abandon: give up after this long; disconnect: after this many chunks (int)


@dataclass
class Outcome:
    spec: Spec
    status: str               # completed | failed | aborted (by the client) | refused
    text: str = ""
    detail: str = ""
    http_status: int | None = None


@dataclass
class Probe:
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


# -- the workload --------------------------------------------------------------------------
def prompt_pool(size: int, rng: random.Random, vocab_size: int) -> list:
    """Text prompts, and token-id prompts (ids from the middle of the vocabulary: ordinary text
    tokens of a BPE vocabulary, never its special tokens at the end)."""
    pool, low, high = [], vocab_size // 100, vocab_size * 3 // 4
    for i in range(size):
        if i % 3 == 2:
            pool.append([rng.randrange(low, high) for _ in range(rng.randrange(4, 60))])
        else:
            pool.append(" ".join(rng.choice(SENTENCES) for _ in range(rng.randrange(1, 4))))
    return pool


def make_specs(args, pool, rng: random.Random) -> list[Spec]:
    """num_requests specs: every bad body once and two huge prompts, at random places in a
    weighted random mix of the rest."""
    mix = [("text", 22), ("text_stream", 22), ("chat", 10), ("chat_stream", 10), ("seeded", 12),
           ("abandon", 10), ("disconnect", 12)]
    kinds, weights = zip(*mix)
    lengths = [rng.randrange(args.min_tokens, args.max_tokens + 1) for _ in pool]   # one per prompt
    text_prompts = [i for i, p in enumerate(pool) if isinstance(p, str)]           # chat needs text
    specs = [Spec("bad", i) for i in range(len(BAD_BODIES))] + [Spec("huge", 0), Spec("huge", 1)]
    while len(specs) < args.num_requests:
        kind = rng.choices(kinds, weights)[0]
        index = rng.choice(text_prompts) if kind.startswith("chat") else rng.randrange(len(pool))
        delay = rng.uniform(0.05, 1.0) if kind == "abandon" else rng.randrange(1, 4)
        specs.append(Spec(kind, index, lengths[index], seed=index * 7919 + 1, delay_s=delay))
    rng.shuffle(specs)
    return specs


def sampling(spec: Spec) -> dict:
    if spec.kind == "seeded":
        return {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": spec.seed}
    return {"temperature": 0.0}


def compared_key(spec: Spec):
    """Requests whose text must equal the offline run's, keyed by what determines that text."""
    if spec.kind in ("text", "text_stream"):
        return ("text", spec.index)
    if spec.kind in ("chat", "chat_stream"):
        return ("chat", spec.index)
    if spec.kind == "seeded":
        return ("seeded", spec.index)
    return None


def offline_reference(args, pool, specs) -> dict:
    """key -> (prompt token ids, generated token ids, text), from LLM.generate in this process."""
    from tinyvllm.engine.llm import LLM
    from tinyvllm.engine.sampling_params import SamplingParams
    keys = sorted({k for s in specs if (k := compared_key(s))}, key=repr)
    by_key = {compared_key(s): s for s in specs if compared_key(s)}
    llm = LLM(args.model, **engine_options(args))
    HUGE_PROMPT_BYTES[0] = (llm.engine.max_prompt_bytes or 1 << 20) - 64
    try:
        prompts, params = [], []
        for key in keys:
            spec = by_key[key]
            prompt = pool[spec.index]
            if key[0] == "chat":
                prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}])
            prompts.append({"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt)
            params.append(SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, **sampling(spec)))
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {k: (o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for k, o in zip(keys, outs)}
    finally:
        llm.engine.close()


def engine_options(args) -> dict:
    return dict(device=args.device, num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, async_scheduling=args.async_scheduling)


# -- the client ----------------------------------------------------------------------------
def body_for(spec: Spec, pool, model: str) -> dict | bytes:
    if spec.kind == "bad":
        bad = BAD_BODIES[spec.index][1]
        return bad if isinstance(bad, bytes) else {"model": model, "prompt": "Hello", "max_tokens": 4, **bad}
    if spec.kind == "huge":
        # 0: 4 MB of text, refused unread (more bytes than any text that fits the context);
        # 1: the longest text that may fit, encoded in full (in the server's worker pool, while
        # the rest runs) and then refused: more tokens than the context
        text = "lorem ipsum " * 350_000 if spec.index == 0 else varied_text(HUGE_PROMPT_BYTES[0])
        return {"model": model, "prompt": text, "max_tokens": 4}
    body = {"model": model, "max_tokens": spec.max_tokens, "ignore_eos": True, **sampling(spec),
            "stream": spec.kind.endswith("_stream") or spec.kind == "disconnect"}
    if spec.kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": pool[spec.index]}]
    else:
        body["prompt"] = pool[spec.index]
    return body


def varied_text(size: int) -> str:
    """Words with numbers, which BPE cannot merge into a few long tokens: slow to encode."""
    rng, parts, n = random.Random(size), [], 0
    while n < size:
        parts.append(f"{rng.choice(SENTENCES).split()[0]}{rng.randrange(1000)}")
        n += len(parts[-1]) + 1
    return " ".join(parts)[:size]


def stream_text(payload: dict, chat: bool) -> str:
    choice = (payload.get("choices") or [{}])[0]
    return (choice.get("delta", {}).get("content") or "") if chat else (choice.get("text") or "")


async def send(client: httpx.AsyncClient, spec: Spec, pool, model: str) -> Outcome:
    body = body_for(spec, pool, model)
    chat = spec.kind.startswith("chat")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    try:
        if spec.kind == "abandon":
            try:
                await asyncio.wait_for(client.post(path, **kwargs), spec.delay_s)
            except asyncio.TimeoutError:
                pass
            return Outcome(spec, "aborted")
        if isinstance(body, dict) and body.get("stream"):
            return await _streamed(client, spec, path, kwargs, chat)
        r = await client.post(path, **kwargs)
    except httpx.HTTPError as e:
        return Outcome(spec, "failed", detail=f"{type(e).__name__}: {e}")
    if spec.kind in ("bad", "huge"):
        ok = 400 <= r.status_code < 500 and "Traceback" not in r.text
        return Outcome(spec, "refused" if ok else "failed", http_status=r.status_code,
                       detail="" if ok else r.text[:200])
    if r.status_code != 200:
        return Outcome(spec, "failed", http_status=r.status_code, detail=r.text[:200])
    choice = r.json()["choices"][0]
    if choice["finish_reason"] != "length":
        return Outcome(spec, "failed", detail=f"finish_reason {choice['finish_reason']}")
    return Outcome(spec, "completed", choice["message"]["content"] if chat else choice["text"], http_status=200)


async def _streamed(client, spec: Spec, path: str, kwargs, chat: bool) -> Outcome:
    parts, chunks, finish = [], 0, None
    async with client.stream("POST", path, **kwargs) as r:
        if r.status_code != 200:
            return Outcome(spec, "failed", http_status=r.status_code, detail=(await r.aread())[:200].decode())
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            payload = json.loads(data)
            if "error" in payload:
                return Outcome(spec, "failed", detail=str(payload["error"])[:200])
            parts.append(stream_text(payload, chat))
            finish = (payload.get("choices") or [{}])[0].get("finish_reason") or finish
            chunks += 1
            if spec.kind == "disconnect" and chunks >= int(spec.delay_s):
                return Outcome(spec, "aborted")          # leaving the block closes the connection
    if spec.kind == "disconnect":                       # finished before we could leave
        return Outcome(spec, "aborted", detail="finished first")
    if finish != "length":
        return Outcome(spec, "failed", detail=f"stream ended with finish_reason {finish}")
    return Outcome(spec, "completed", "".join(parts), http_status=200)


async def probe_health(client: httpx.AsyncClient, probe: Probe, stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        try:
            r = await client.get("/health", timeout=30)
            if r.status_code != 200:
                probe.failures.append(f"{r.status_code} {r.text[:100]}")
        except httpx.HTTPError as e:
            probe.failures.append(f"{type(e).__name__}: {e}")
        probe.latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.1)


async def run_load(url: str, specs, pool, model: str, concurrency: int, timeout_s: float):
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(timeout_s),
                                 trust_env=False) as client, \
            httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as health_client:
        queue: asyncio.Queue = asyncio.Queue()
        for spec in specs:
            queue.put_nowait(spec)
        outcomes: list[Outcome] = []

        async def worker():
            while not queue.empty():
                outcomes.append(await send(client, queue.get_nowait(), pool, model))

        probe, stop = Probe(), asyncio.Event()
        health = asyncio.ensure_future(probe_health(health_client, probe, stop))
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout_s)
        elapsed = time.perf_counter() - start
        stop.set()
        await health
        return outcomes, probe, elapsed


# -- the server ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def start_server(args, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tinyvllm", "serve", "--model", str(args.model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "soak", "--device", args.device,
           "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs)]
    if args.async_scheduling is not None:
        cmd.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"soak: the server exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    sys.exit("soak: the server did not become healthy in time")


def stop_server(server: subprocess.Popen, log_path: Path) -> dict:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log = log_path.read_text(errors="replace")
    found = re.search(r"engine loop stopped: (\d+) KV blocks free of (\d+), (\d+) preemptions", log)
    if not found:
        return {"exit_code": server.returncode, "log_tail": log[-2000:]}
    free, total, preemptions = map(int, found.groups())
    return {"exit_code": server.returncode, "kv_blocks_total": total, "kv_blocks_leaked": total - free,
            "preemptions": preemptions, "tracebacks_in_log": log.count("Traceback")}


# -- checking ------------------------------------------------------------------------------
def departure(text: str, prompt_ids: list, token_ids: list, decode, forward_full):
    """Where a greedy run that printed `text` left the offline run's `token_ids`, and the fp32
    top-2 logit gap there -> (j, gap, fork), or None when the tokens decode to `text` in full.

    By text, the run left at j, the first offline token the text does not go on with. But it
    may have left earlier without changing the text, at a token boundary of its own ('\n\n' as
    one token where the offline run has '\n' twice): the fp32 logits then differ from j on, and
    the gap at j says nothing. Every earlier position i whose fp32 runner-up token also goes on
    with the text is such a possible fork; the smallest gap among those forks and position j is
    returned (fork = its position; fork == j: no earlier fork was closer to a tie). One fp32
    forward pass over prompt + token_ids[:j] gives all the positions' logits."""
    j = 0
    while j < len(token_ids) and text.startswith(decode(token_ids[:j + 1])):
        j += 1
    if j == len(token_ids):
        return None
    logits = np.asarray(forward_full(list(prompt_ids) + list(token_ids[:j])), np.float64)
    rows = logits[len(prompt_ids) - 1:]              # row i: the logits that picked token i

    def top2(i):
        """(the top-2 token that is not the offline pick, the fp32 gap between the top two)"""
        second, first = (int(t) for t in np.argsort(rows[i])[-2:])
        return (second if first == token_ids[i] else first), float(rows[i][first] - rows[i][second])

    best_gap, fork = top2(j)[1], j
    for i in range(j):
        other, gap = top2(i)
        if gap < best_gap and text.startswith(decode(list(token_ids[:i]) + [other])):
            best_gap, fork = gap, i
    return j, best_gap, fork


def bf16_noise(model, twin, sequences) -> float:
    """The largest |fp32 - bf16 twin| logit over every position of `sequences` (token id lists)."""
    return max(float(np.abs(np.asarray(model.forward_full(list(ids)), np.float64)
                            - np.asarray(twin.forward_full(list(ids)), np.float64)).max()) for ids in sequences)


def classify_mismatches(args, outcomes, reference) -> dict:
    """Completed requests whose text differs from the offline run's. Greedy ones on the GPU are
    "explained" by a near-tie where they left the offline tokens (departure(); a near-tie: a gap under
    report["near_tie"], NOISE_RATIO times bf16_noise(); each check is one fp32 numpy forward
    pass, about a second for a 1B model; those left when --classify-timeout runs out count as
    unexplained: the run is then inconclusive). Seeded sampling is reported apart: on the GPU a
    batch-dependent rounding can move a draw across a token boundary, so only the numpy
    backend (exact whatever the batch) holds it to equality. On the numpy backend every
    mismatch counts."""
    bad = [(o, reference[compared_key(o.spec)]) for o in outcomes
           if o.status == "completed" and compared_key(o.spec) and o.text != reference[compared_key(o.spec)][2]]
    greedy = [(o, ref) for o, ref in bad if o.spec.kind != "seeded"]
    report = {"mismatches": len(greedy), "mismatches_unexplained": len(greedy),
              "seeded_mismatches": len(bad) - len(greedy)}
    if not greedy or args.device == "cpu":
        return report
    from tinyvllm.checkpoint.tokenizer import Tokenizer
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    from tinyvllm.reference.model import ReferenceModel
    config = ModelConfig.from_pretrained(args.model)
    tokenizer = Tokenizer.from_pretrained(args.model, config)
    weights = load_weights(args.model, config)
    model = ReferenceModel(config, weights)
    near_tie = NOISE_RATIO * bf16_noise(model, ReferenceModel(config, weights, round_bf16=True),
                                        [list(ref[0]) + list(ref[1]) for _, ref in greedy[:NOISE_SAMPLES]])
    report["near_tie"] = round(near_tie, 4)
    unexplained, deadline, details = 0, time.monotonic() + args.classify_timeout, []
    for k, (outcome, (prompt_ids, token_ids, _)) in enumerate(greedy):
        if time.monotonic() > deadline:
            print(f"soak: --classify-timeout: {len(greedy) - k} mismatches left unclassified", file=sys.stderr)
            unexplained += len(greedy) - k
            break
        what = f"{outcome.spec.kind} #{outcome.spec.index}"
        found = departure(outcome.text, list(prompt_ids), list(token_ids), tokenizer.decode, model.forward_full)
        if found is None:
            unexplained += 1                     # the same tokens, yet another text
            details.append(f"{what}: the same {len(token_ids)} tokens, another text (UNEXPLAINED)")
            continue
        j, gap, fork = found
        unexplained += gap >= near_tie
        where = (f"a fork at token {fork} (same text, another token boundary)" if fork != j
                 else f"token {j}")
        details.append(f"{what}: departs at {where} of {len(token_ids)}, fp32 top-2 gap {gap:.3f}"
                       + (" (near-tie)" if gap < near_tie else " (UNEXPLAINED)"))
    report["mismatches_unexplained"] = unexplained
    report["mismatch_details"] = sorted(details, key=lambda d: "UNEXPLAINED" not in d)[:12]
    return report


def summarize(args, outcomes, probe, elapsed, server_report, mismatches, rss_before, rss_after) -> dict:
    status = Counter(o.status for o in outcomes)
    by_kind = Counter((o.spec.kind, o.status) for o in outcomes)
    lat = sorted(probe.latencies) or [0.0]
    failed = [f"{o.spec.kind}: {o.http_status} {o.detail}" for o in outcomes if o.status == "failed"]
    bad = {BAD_BODIES[o.spec.index][0]: o.http_status for o in outcomes if o.spec.kind == "bad"}
    return {
        "requests": len(outcomes), "concurrency": args.concurrency, "elapsed_s": round(elapsed, 1),
        "completed": status["completed"], "failed": status["failed"], "aborted": status["aborted"],
        "refused_4xx": status["refused"], "by_kind": {f"{k}/{s}": n for (k, s), n in sorted(by_kind.items())},
        "compared": sum(o.status == "completed" and compared_key(o.spec) is not None for o in outcomes),
        **mismatches,
        **{k: v for k, v in server_report.items() if k != "log_tail"},
        "rss_mb_after_warmup": round(rss_before, 1), "rss_mb_after": round(rss_after, 1),
        "rss_growth_mb": round(rss_after - rss_before, 1),
        "health_p50_ms": round(1000 * lat[len(lat) // 2], 1), "health_p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 1),
        "health_max_ms": round(1000 * lat[-1], 1), "health_failures": len(probe.failures),
        "first_health_failures": probe.failures[:3],
        "bad_request_statuses": bad, "first_failures": failed[:8], "device": args.device, "model": str(args.model),
        "async_scheduling": args.async_scheduling,
        "num_kv_blocks": args.num_kv_blocks, "max_model_len": args.max_model_len,
    }


def passed(s: dict) -> bool:
    seeded_ok = s["seeded_mismatches"] == 0 or s["device"] != "cpu"
    return (s["failed"] == 0 and s["mismatches_unexplained"] == 0 and s.get("kv_blocks_leaked") == 0
            and seeded_ok
            and s.get("preemptions", 0) > 0 and s["health_failures"] == 0 and s.get("exit_code") == 0
            and s.get("tracebacks_in_log") == 0
            and s["completed"] > 0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI-sized: numpy backend, tiny preset, 96 requests")
    p.add_argument("--model", default=None, help="model directory (default: --preset's, written once)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model-cache", default="/tmp/tinyvllm-models")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="small, to force preemptions")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--pool", type=int, default=None, help="distinct prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="for the load itself (s)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--classify-timeout", type=float, default=180.0,
                   help="GPU: seconds for checking greedy mismatches against the fp32 reference")
    p.add_argument("--json", default=None, help="write the report here too")
    p.add_argument("--server-log", default=None, help="keep the server's log here")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the server's and the offline engine's (default: the engine's own default)")
    args = p.parse_args(argv)
    # quick: 16 blocks and up to 16 tokens, so that running rows grow into new blocks while
    # admissions have taken the rest (decode rows get their blocks before prompts do: a smaller
    # cache or shorter outputs preempt only now and then)
    quick = dict(device="cpu", num_requests=96, concurrency=16, min_tokens=2, max_tokens=16,
                 num_kv_blocks=16, max_model_len=256, pool=16)
    full = dict(device="cuda", num_requests=1000, concurrency=64, min_tokens=8, max_tokens=64,
                num_kv_blocks=160, max_model_len=1024, pool=64)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from tinyvllm.bench.run import resolve_model
        args.model = resolve_model(None, args.preset, Path(args.model_cache))
    rng = random.Random(args.seed)
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    pool = prompt_pool(args.pool, rng, vocab_size)
    specs = make_specs(args, pool, rng)
    t = time.perf_counter()
    reference = offline_reference(args, pool, specs)
    print(f"soak: {len(reference)} offline reference runs in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(args.server_log or Path(tmp) / "server.log")
        server = start_server(args, port, log_path)
        try:
            warm = [Spec("text", i, 2) for i in range(min(4, len(pool)))]
            asyncio.run(run_load(url, warm, pool, "soak", 4, 300))
            rss_before = rss_mb(server.pid)
            outcomes, probe, elapsed = asyncio.run(run_load(url, specs, pool, "soak", args.concurrency, args.timeout))
            rss_after = rss_mb(server.pid)
        finally:
            server_report = stop_server(server, log_path)
    mismatches = classify_mismatches(args, outcomes, reference)
    summary = summarize(args, outcomes, probe, elapsed, server_report, mismatches, rss_before, rss_after)
    summary["passed"] = passed(summary)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if "log_tail" in server_report:
        print(server_report["log_tail"], file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
