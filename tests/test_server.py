"""The OpenAI-compatible server, end to end on the numpy backend: a real LLMEngine behind a real
uvicorn on a free 127.0.0.1 port, driven by the official `openai` client and raw httpx."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tinyvllm.engine.sampling_params import SamplingParams  # noqa: E402

API_KEY = "test-key"
MODEL_NAME = "tiny"
ENGINE_OPTIONS = dict(device="cpu", max_model_len=256)


class LiveServer:
    """uvicorn serving `app` from a daemon thread on a socket we bound ourselves (port 0: the OS
    picks a free port, so parallel test runs never collide)."""

    def __init__(self, app):
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from tinyvllm.server.launch import ServeOptions, build_server
    app, engine_loop = build_server(ServeOptions(model=str(tiny_model_dir), api_key=API_KEY,
                                                 served_model_names=(MODEL_NAME,),
                                                 engine_options=ENGINE_OPTIONS))
    with LiveServer(app) as live:
        live.engine_loop = engine_loop
        live.total_blocks = free_blocks(engine_loop)
        yield live


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from tinyvllm.engine.llm import LLM
    return LLM(str(tiny_model_dir), **ENGINE_OPTIONS)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def free_blocks(engine_loop) -> int:
    return engine_loop.call(lambda engine: engine.num_free_blocks).result(timeout=30)


def wait_for_free_blocks(served, timeout=30.0) -> int:
    """Poll until every KV block is free again (aborts are applied asynchronously)."""
    deadline = time.monotonic() + timeout
    while (free := free_blocks(served.engine_loop)) != served.total_blocks:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return free


def greedy_offline(offline, prompts, max_tokens) -> list[str]:
    outs = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].text for o in outs]


# ---- the happy paths ---------------------------------------------------------------------------

def test_health_and_models(served, client):
    assert httpx.get(served.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion_matches_offline_with_usage(served, client, offline):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    expected = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.object == "text_completion"
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from tinyvllm.checkpoint.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(tiny_model_dir)


def test_completion_accepts_token_ids(client, tokenizer):
    ids = tokenizer.encode("Hello there")
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens >= 1


def test_chat_completion(client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hi."}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                         temperature=0, seed=1)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert 1 <= out.usage.completion_tokens <= 6
    # the prompt is the model's chat template (Llama 3.2's) with a single BOS
    prompt_ids = tokenizer.encode_chat(messages)
    assert prompt_ids.count(tokenizer.bos_token_id) == 1
    assert out.usage.prompt_tokens == len(prompt_ids)
    # text parts are joined with "\n" for this string-content template, as vLLM does
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Say"},
                                                       {"type": "text", "text": "hi."}]}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=1)
    assert out.usage.prompt_tokens == len(tokenizer.encode_chat(
        [messages[0], {"role": "user", "content": "Say\nhi."}]))


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_stream_concatenates_to_non_streamed_text(client, chat):
    kwargs = dict(model=MODEL_NAME, max_tokens=10, temperature=0)
    if chat:
        kwargs["messages"] = [{"role": "user", "content": "Count to five."}]
        create = client.chat.completions.create
        text_of = lambda c: c.choices[0].delta.content or ""          # noqa: E731
        whole = create(**kwargs).choices[0].message.content
    else:
        kwargs["prompt"] = "One, two, three,"
        create = client.completions.create
        text_of = lambda c: c.choices[0].text                          # noqa: E731
        whole = create(**kwargs).choices[0].text
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kwargs))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(text_of(c) for c in with_choices) == whole
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    if chat:
        assert with_choices[0].choices[0].delta.role == "assistant"


def test_raw_sse_format_and_harmless_fields(served):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "stream": True,
            "temperature": 0, "user": "u1", "logprobs": None, "frequency_penalty": 0,
            "presence_penalty": 0.0, "echo": False, "best_of": 1, "some_new_field": {"x": 1}}
    with httpx.stream("POST", served.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_NAME for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


# ---- errors ------------------------------------------------------------------------------------

def post(served, path, body, key=API_KEY, raw=False):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    content = body if raw else json.dumps(body)
    return httpx.post(served.url + path, content=content, headers=headers, timeout=60)


BAD_COMPLETIONS = {
    "malformed json": b'{"model": "tiny", "prompt": ',
    "not an object": [1, 2, 3],
    "missing prompt": {"model": MODEL_NAME},
    "prompt wrong type": {"model": MODEL_NAME, "prompt": 42},
    "max_tokens wrong type": {"model": MODEL_NAME, "prompt": "x", "max_tokens": "5"},
    "temperature wrong type": {"model": MODEL_NAME, "prompt": "x", "temperature": "hot"},
    "n 0": {"model": MODEL_NAME, "prompt": "x", "n": 0},
    "best_of above n": {"model": MODEL_NAME, "prompt": "x", "best_of": 3},
    "beam search": {"model": MODEL_NAME, "prompt": "x", "use_beam_search": True},
    "guided regex that cannot compile": {"model": MODEL_NAME, "prompt": "x", "guided_regex": "(a"},
    "logit_bias key not an id": {"model": MODEL_NAME, "prompt": "x", "logit_bias": {"a": 1.0}},
    "min_p above 1": {"model": MODEL_NAME, "prompt": "x", "min_p": 1.5},
    "max_tokens beyond the context": {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**6},
    "negative temperature": {"model": MODEL_NAME, "prompt": "x", "temperature": -1.0},
    "top_p > 1": {"model": MODEL_NAME, "prompt": "x", "top_p": 1.5},
    "max_tokens 0": {"model": MODEL_NAME, "prompt": "x", "max_tokens": 0},
    "empty prompt": {"model": MODEL_NAME, "prompt": ""},
    "token id out of vocab": {"model": MODEL_NAME, "prompt": [1, 10**9]},
    "negative token id": {"model": MODEL_NAME, "prompt": [-1, 5]},
    "token id out of vocab in a batch": {"model": MODEL_NAME, "prompt": [[1, 2], [3, 10**9]]},
    "prompt beyond context": {"model": MODEL_NAME, "prompt": "hello " * 400},
    "logprobs above 20": {"model": MODEL_NAME, "prompt": "x", "logprobs": 21},
}


@pytest.mark.parametrize("body", BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())
def test_bad_completion_requests_are_400(served, body):
    r = post(served, "/v1/completions", body, raw=isinstance(body, bytes))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body", [
    {"model": MODEL_NAME},
    {"model": MODEL_NAME, "messages": []},
    {"model": MODEL_NAME, "messages": "hi"},
    {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi " * 400}]},
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 0},
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "echo": True},
], ids=["missing messages", "no messages", "messages wrong type", "bad role", "too long", "n=0",
        "top_logprobs 21", "echo"])
def test_bad_chat_requests_are_400(served, body):
    r = post(served, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_bad_values_through_the_openai_client_then_server_still_serves(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=-2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, n=0, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices[0].text is not None


def test_no_cors_unless_asked_for(served):
    r = httpx.options(served.url + "/v1/completions", headers={
        "Origin": "http://a.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(served.url + "/health", headers={"Origin": "http://a.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_api_key_is_enforced(served):
    wrong = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    r = httpx.get(served.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/health").status_code == 200   # health stays open


# ---- concurrency, disconnects, failures --------------------------------------------------------

def test_100_concurrent_streams_match_offline_greedy(served, offline):
    prompts = [f"Request number {i}: the answer is" for i in range(100)]
    max_tokens = 6

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                                 max_tokens=max_tokens, temperature=0)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=API_KEY,
                                      max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(asyncio.wait_for(all_of_them(), timeout=300))
    assert texts == greedy_offline(offline, prompts, max_tokens)
    assert wait_for_free_blocks(served) == served.total_blocks


def test_client_disconnect_mid_stream_frees_blocks(served):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", served.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert free_blocks(served.engine_loop) < served.total_blocks   # it is in flight
        # leaving the block closes the connection mid-stream
    assert wait_for_free_blocks(served) == served.total_blocks


def test_client_gone_during_non_streamed_request_frees_blocks(served):
    body = json.dumps({"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 200,
                       "ignore_eos": True}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:   # raw HTTP: we choose when to hang up
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while free_blocks(served.engine_loop) == served.total_blocks:   # wait until it runs
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
    assert wait_for_free_blocks(served) == served.total_blocks


def test_engine_exception_fails_requests_with_500_and_loop_keeps_serving(served, client):
    engine = served.engine_loop.engine
    real_step = engine.step

    def step_that_fails_once(**_):
        engine.step = real_step           # engine thread: the next step is a normal one
        raise RuntimeError("injected engine failure")

    served.engine_loop.call(lambda e: setattr(e, "step", step_that_fails_once)).result(10)
    try:
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4)
    finally:
        served.engine_loop.call(lambda e: setattr(e, "step", real_step)).result(10)
    assert wait_for_free_blocks(served) == served.total_blocks
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices
    assert httpx.get(served.url + "/health").status_code == 200


# ---- the real command line ---------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_answers_and_stops_cleanly_on_ctrl_c(tiny_model_dir):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinyvllm", "serve", "--model", str(tiny_model_dir), "--device",
         "cpu", "--max-model-len", "256", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        models = httpx.get(url + "/v1/models").json()["data"]
        assert models[0]["id"] == str(tiny_model_dir)      # default served name: --model as given
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": str(tiny_model_dir), "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            output = proc.communicate(timeout=30)[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output


def test_serve_chat_template_option_reaches_the_tokenizer(tiny_model_dir, tmp_path):
    from tinyvllm.server.launch import ServeOptions, build_server
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[-1]['content'] }}")
    _, engine_loop = build_server(ServeOptions(model=str(tiny_model_dir), chat_template=str(template),
                                               engine_options={"device": "cpu", "num_kv_blocks": 8, "max_model_len": 128}))
    tokenizer = engine_loop.engine.tokenizer
    assert tokenizer.chat_template.source == str(template)
    assert tokenizer.encode_chat([{"role": "user", "content": "Hi"}]) == tokenizer.encode("Hi", add_special_tokens=False)
    engine_loop.engine.close()


# ---- vLLM's sampling features over the API (openai client) ------------------------------------

def test_n_choices_per_prompt_greedy_equal_offline(served, client, offline):
    prompts = ["The sky is", "Once upon a time"]
    expected = greedy_offline(offline, prompts, 6)
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert out.usage.prompt_tokens == sum(len(offline.get_tokenizer().encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 4 * 6 or all(c.finish_reason == "stop" for c in out.choices)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, n=3, temperature=0.9, seed=1,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert [c.index for c in chat.choices] == [0, 1, 2]
    stream = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2,
                                       stream=True)
    texts, finishes = [""] * 4, [0] * 4
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] += c.finish_reason is not None
    assert texts == [expected[0], expected[0], expected[1], expected[1]] and finishes == [1] * 4


def test_completion_logprobs_and_echo(served, client, offline):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert lp.token_logprobs == [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)]
    assert lp.tokens == [e[t].decoded_token for t, e in zip(ref.token_ids, ref.logprobs)]
    assert all(len(top) in (2, 3) for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    echoed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + out.choices[0].text
    both = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                     logprobs=1)
    n_prompt = len(offline.get_tokenizer().encode(prompt))
    blp = both.choices[0].logprobs
    assert len(blp.tokens) == n_prompt + 4 and blp.token_logprobs[0] is None
    assert blp.token_logprobs[n_prompt:] == lp.token_logprobs
    assert blp.text_offset[n_prompt] == len(prompt)


def test_chat_logprobs(served, client):
    out = client.chat.completions.create(model=MODEL_NAME, max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2, messages=[{"role": "user", "content": "Hi"}])
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token   # greedy
        assert item.bytes == list(item.token.encode("utf-8")) and item.logprob <= 0
    r = post(served, "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2, "top_logprobs": 2,
                                              "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_vllm_extra_fields_are_honoured(served, client, offline):
    prompt = "Once upon a time"
    full = greedy_offline(offline, [prompt], 10)[0]
    stop = full[3:6]
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True, "min_tokens": 0,
                                                "skip_special_tokens": True, "top_k": 5})
    assert out.choices[0].text == full[:full.index(stop) + len(stop)]
    ids = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0].token_ids
    by_id = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"stop_token_ids": [ids[2]]})
    assert by_id.choices[0].finish_reason == "stop"


def test_unsupported_fields_and_long_max_tokens_are_400_naming_them(served, client):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"use_beam_search": True})
    assert "use_beam_search" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1000)
    assert "This model's maximum context length is 256 tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=1000, messages=[{"role": "user", "content": "Hi"}])
    assert "max_tokens=1000" in str(e.value)
