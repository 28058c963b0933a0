"""Prompts are encoded off the event loop and off the engine thread (tinyvllm/server/encoding.py):
while a huge prompt is encoded, /health answers as fast as it did before, and the engine thread
never tokenizes."""
from __future__ import annotations

import random
import statistics
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_server import LiveServer  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "lorem", "ipsum", "sea", "poem", "the", "capital"]


@pytest.fixture(scope="module")
def big_context_server(tiny_model_dir):
    """The tiny model with a 4096-token context: the longest text it admits (4096 tokens x the
    longest token's 256 bytes = 1 MiB) takes about a second to encode on a CPU."""
    from tinyvllm.server.launch import ServeOptions, build_server
    app, engine_loop = build_server(ServeOptions(
        model=str(tiny_model_dir), served_model_names=("tiny",), log_requests=False,
        engine_options=dict(device="cpu", max_model_len=4096)))
    with LiveServer(app) as live:
        live.engine = engine_loop.engine
        yield live


def varied_text(size: int) -> str:
    """Words with numbers: BPE cannot merge them into a few long tokens, so encoding is slow."""
    rng, parts, n = random.Random(0), [], 0
    while n < size:
        parts.append(f"{rng.choice(WORDS)}{rng.randrange(1000)}")
        n += len(parts[-1]) + 1
    return " ".join(parts)[:size]


def health_seconds(client) -> float:
    start = time.perf_counter()
    assert client.get("/health").status_code == 200
    return time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_health_answers_while_a_huge_prompt_is_encoded(big_context_server, route):
    engine = big_context_server.engine
    text = varied_text(engine.max_prompt_bytes - 64)          # admitted: it is encoded in full
    body = ({"prompt": text, "max_tokens": 4} if route == "completions" else
            {"messages": [{"role": "user", "content": text}], "max_tokens": 4})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"

    # every way text reaches the tokenizer: Tokenizer.encode, and content_tokens.encode (chat)
    from tinyvllm.checkpoint import content_tokens
    encoding_threads = []

    def recording(encode):
        def wrapper(*args, **kwargs):
            encoding_threads.append(threading.current_thread().name)
            return encode(*args, **kwargs)
        return wrapper

    engine.tokenizer.encode = recording(engine.tokenizer.encode)
    content_encode = content_tokens.encode
    content_tokens.encode = recording(content_encode)
    try:
        with httpx.Client(base_url=big_context_server.url, timeout=120, trust_env=False) as client:
            baseline = [health_seconds(client) for _ in range(30)]
            answer = {}

            def post():
                with httpx.Client(base_url=big_context_server.url, timeout=120, trust_env=False) as c:
                    answer["response"] = c.post(path, json=body)

            poster = threading.Thread(target=post)
            start = time.perf_counter()
            poster.start()
            during = []
            while poster.is_alive():
                during.append(health_seconds(client))
                time.sleep(0.005)
            elapsed = time.perf_counter() - start
            poster.join()
    finally:
        del engine.tokenizer.encode
        content_tokens.encode = content_encode
    response = answer["response"]
    # the text fits the byte bound but not the context: refused after it was encoded in full
    assert response.status_code == 400, response.text
    assert "tokens" in response.json()["error"]["message"]
    # A loop blocked by the encoding holds the /health request that arrives while it runs for
    # the rest of the encoding: one answer of about the request's whole time. An answer that
    # comes back in under half of it shows the loop free. The idle answers only check that the
    # encoding takes long enough for that to tell anything: their median, not their slowest, is
    # the yardstick (on a loaded 2-core CI machine one idle answer in 30 can take 250 ms).
    bound = elapsed / 2
    print(f"{route}: {len(text):,} bytes encoded in {elapsed:.2f} s; /health idle median "
          f"{1000 * statistics.median(baseline):.1f} ms, max {1000 * max(baseline):.1f} ms; while "
          f"encoding {len(during)} answers, max {1000 * max(during):.1f} ms (bound {1000 * bound:.0f} ms)")
    # The test tells the two apart when a free loop's answer (about the idle median) stays well
    # under the bound: bound = elapsed / 2 >= 2 x the idle median, i.e. elapsed >= 4 x it. (The
    # idle answer on loopback can be ~44 ms, TCP's delayed ACK, against a ~0.4 s encoding.)
    assert elapsed > 4 * statistics.median(baseline), "the encoding was too quick for this test to tell anything"
    assert len(during) >= 3
    assert max(during) < bound
    assert encoding_threads and all(name.startswith("tinyvllm-encode") for name in encoding_threads), \
        encoding_threads


def test_engine_takes_a_tokenized_prompt_as_it_is(tiny_model_dir):
    from tinyvllm.engine.intake import TokenizedPrompt
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.engine.sampling_params import SamplingParams
    from tinyvllm.errors import InvalidRequestError
    engine = LLMEngine(tiny_model_dir, device="cpu", max_model_len=256)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = engine.tokenizer.encode("The capital of France is")
    engine.add_request("text", "The capital of France is", params)
    engine.add_request("ids", TokenizedPrompt("The capital of France is", tuple(ids)), params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["ids"].prompt_token_ids == done["text"].prompt_token_ids == ids
    assert done["ids"].outputs[0].token_ids == done["text"].outputs[0].token_ids
    assert done["ids"].prompt == "The capital of France is"
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine.add_request("bad", TokenizedPrompt("x", (engine.model_config.vocab_size,)), params)
