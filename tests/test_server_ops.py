"""The operational surface of the server, end to end on the numpy backend: /metrics counting
what requests did, /tokenize and /detokenize against the tokenizer, CORS, several served model
names and an optional `model`, batched completion prompts; and the real command line: the
positional model, SIGTERM draining and exiting 0, argument errors."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_server import LiveServer, _free_port  # noqa: E402

from tinyvllm.cli import main  # noqa: E402
from tinyvllm.engine.sampling_params import SamplingParams  # noqa: E402

API_KEY = "ops-key"
NAMES = ("tiny", "tiny-alias")
ALLOWED = "http://allowed.example"
ENGINE_OPTIONS = dict(device="cpu", max_model_len=256)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from tinyvllm.server.launch import ServeOptions, build_server
    app, engine_loop = build_server(ServeOptions(
        model=str(tiny_model_dir), api_key=API_KEY, served_model_names=NAMES,
        engine_options=ENGINE_OPTIONS, allowed_origins=(ALLOWED,)))
    with LiveServer(app) as live:
        live.engine_loop = engine_loop
        yield live


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from tinyvllm.checkpoint.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from tinyvllm.engine.llm import LLM
    return LLM(str(tiny_model_dir), **ENGINE_OPTIONS)


def scrape(served) -> dict[str, float]:
    """{'name{label="value",...}': value} for every tinyvllm sample (model_name label left out)."""
    r = httpx.get(served.url + "/metrics")          # no API key: as vLLM, /metrics is open
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == NAMES[0]
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_idle(served, timeout=30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(served)
        if m["tinyvllm:num_requests_running"] == 0 and m["tinyvllm:num_requests_waiting"] == 0 \
                and m["tinyvllm:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


# ---- /metrics ----------------------------------------------------------------------------------

DOCUMENTED = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
              "prefix_cache_queries_total", "prefix_cache_hits_total",
              'request_success_total{finished_reason="stop"}',
              'request_success_total{finished_reason="length"}',
              'request_success_total{finished_reason="abort"}',
              "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
              "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
              "request_inference_time_seconds_count", "request_prefill_time_seconds_count",
              "request_decode_time_seconds_count", "request_time_per_output_token_seconds_count",
              "request_prompt_tokens_count", "request_generation_tokens_count",
              "request_params_max_tokens_count", "iteration_tokens_total_count"]


def test_metrics_are_all_there_and_documented(served):
    m = scrape(served)
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "server.md")).read()
    for name in DOCUMENTED:
        assert "tinyvllm:" + name in m, name
        assert f"`tinyvllm:{name.split('{')[0].removesuffix('_count')}`" in docs, name
    assert any(k.startswith("tinyvllm:cache_config_info{") and 'num_gpu_blocks="' in k for k in m)


def test_metrics_count_what_the_requests_did(served, client):
    before = wait_idle(served)
    usages = [client.completions.create(model=NAMES[0], prompt=f"Count {i}:", max_tokens=5,
                                        temperature=0, extra_body={"ignore_eos": True}).usage
              for i in range(3)]
    chunks = list(client.completions.create(model=NAMES[0], prompt="Stream:", max_tokens=7,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    after = wait_idle(served)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    prompt, generated = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    assert generated == 3 * 5 + 7
    assert delta['tinyvllm:request_success_total{finished_reason="length"}'] == 4
    assert delta['tinyvllm:request_success_total{finished_reason="stop"}'] == 0
    assert delta["tinyvllm:prompt_tokens_total"] == prompt
    assert delta["tinyvllm:generation_tokens_total"] == generated
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_time_per_output_token_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert delta[f"tinyvllm:{name}_count"] == 4, name
        assert delta[f'tinyvllm:{name}_bucket{{le="+Inf"}}'] == 4, name
    assert delta["tinyvllm:request_prompt_tokens_sum"] == prompt
    assert delta["tinyvllm:request_generation_tokens_sum"] == generated
    assert delta["tinyvllm:request_params_max_tokens_sum"] == 3 * 5 + 7
    # every generated token but each request's first has an inter-token gap
    assert delta["tinyvllm:inter_token_latency_seconds_count"] == generated - 4
    assert delta["tinyvllm:e2e_request_latency_seconds_sum"] > 0
    assert delta["tinyvllm:iteration_tokens_total_sum"] >= prompt + generated - 4


def test_prefix_cache_counters_count_a_shared_prefix(served, client):
    """Two requests sharing a 70-token prefix, one after the other: the first queries all its
    tokens and hits none (its prefix is drawn fresh, so no earlier test cached it), the second
    hits every full block of the shared part that lies short of its last token."""
    before = wait_idle(served)
    block_size = int(next(k for k in before if k.startswith("tinyvllm:cache_config_info{"))
                      .split('block_size="')[1].split('"')[0])
    rng = random.Random(14)
    shared = rng.choices(range(1000, 10000), k=70)
    usages = [client.completions.create(model=NAMES[0], prompt=shared + rng.choices(range(1000, 10000), k=9),
                                        max_tokens=2, temperature=0).usage for _ in range(2)]
    after = wait_idle(served)
    hits = after["tinyvllm:prefix_cache_hits_total"] - before["tinyvllm:prefix_cache_hits_total"]
    queries = after["tinyvllm:prefix_cache_queries_total"] - before["tinyvllm:prefix_cache_queries_total"]
    assert queries == sum(u.prompt_tokens for u in usages) == 2 * 79
    assert hits == 70 // block_size * block_size > 0
    assert queries >= hits


def test_gauges_while_a_request_runs_and_an_abort_is_counted(served):
    before = wait_idle(served)
    body = {"model": NAMES[0], "prompt": "A long story:", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    engine_loop = served.engine_loop
    real_step = engine_loop.engine.step

    def slow_step(**kw):         # 200 steps of at least 20 ms: still running when scraped
        time.sleep(0.02)
        return real_step(**kw)

    engine_loop.call(lambda e: setattr(e, "step", slow_step)).result(10)
    try:
        with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=60) as r:
            lines = r.iter_lines()       # (kept: closing it would close the connection)
            assert next(line for line in lines if line.startswith("data: "))
            during = scrape(served)
    finally:
        engine_loop.call(lambda e: setattr(e, "step", real_step)).result(10)
    assert during["tinyvllm:num_requests_running"] == 1
    assert 0 < during["tinyvllm:kv_cache_usage_perc"] <= 1
    after = wait_idle(served)
    assert after['tinyvllm:request_success_total{finished_reason="abort"}'] == \
        before['tinyvllm:request_success_total{finished_reason="abort"}'] + 1


def test_disable_log_stats_collects_nothing(tiny_model_dir):
    from tinyvllm.server.launch import ServeOptions, build_server
    app, engine_loop = build_server(ServeOptions(model=str(tiny_model_dir), engine_options=ENGINE_OPTIONS,
                                                 log_stats=False))
    with LiveServer(app) as live:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        r = httpx.get(live.url + "/metrics")
        assert r.status_code == 404 and "--disable-log-stats" in r.json()["error"]["message"]
    assert engine_loop.engine.stats is None and engine_loop.engine.last_step_stats is None


# ---- /tokenize, /detokenize, /version, /ping ----------------------------------------------------

def test_tokenize_detokenize_round_trip(served, tokenizer):
    text = "Hello world, é😀! <|eot_id|>"
    r = httpx.post(served.url + "/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["tokens"][0] == tokenizer.bos_token_id
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == [tokenizer.backend.id_to_token(t) for t in body["tokens"]]
    plain = httpx.post(served.url + "/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                        "model": NAMES[1]}).json()
    assert plain["tokens"] == body["tokens"][1:] and plain["token_strs"] is None
    back = httpx.post(served.url + "/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}
    with_bos = httpx.post(served.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert with_bos["prompt"] == tokenizer.decode(body["tokens"], skip_special_tokens=False)


def test_tokenize_chat_matches_the_chat_completion_prompt(served, client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = httpx.post(served.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == tokenizer.encode_chat(messages)
    out = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1)
    assert out.usage.prompt_tokens == r.json()["count"]
    no_prompt = httpx.post(served.url + "/tokenize",
                           json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.encode_chat(messages, add_generation_prompt=False)
    with_bos = httpx.post(served.url + "/tokenize",
                          json={"messages": messages, "add_special_tokens": True}).json()
    assert with_bos["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages))


@pytest.mark.parametrize("path,body,status", [
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404),
    ("/tokenize", {"promt": "x"}, 400),
    ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", b'{"prompt": ', 400),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, 400),
    ("/detokenize", {"tokens": [1, 10**9]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
])
def test_tokenize_errors(served, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body)
    r = httpx.post(served.url + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_version_and_ping(served):
    import tinyvllm
    assert httpx.get(served.url + "/version").json() == {"version": tinyvllm.__version__}
    assert httpx.get(served.url + "/ping").status_code == 200
    assert httpx.post(served.url + "/ping").status_code == 200


# ---- CORS --------------------------------------------------------------------------------------

def preflight(served, origin):
    return httpx.options(served.url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_preflight_only_for_listed_origins(served):
    ok = preflight(served, ALLOWED)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in ok.headers["access-control-allow-methods"]
    refused = preflight(served, "http://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    simple = httpx.get(served.url + "/v1/models", headers={**AUTH, "Origin": ALLOWED})
    assert simple.headers["access-control-allow-origin"] == ALLOWED
    other = httpx.get(served.url + "/v1/models", headers={**AUTH, "Origin": "http://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


# ---- model names -------------------------------------------------------------------------------

def test_several_served_names_and_optional_model(served, client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert client.completions.create(model=NAMES[1], prompt="x", max_tokens=2).model == NAMES[1]
    r = httpx.post(served.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]
    r = httpx.post(served.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-2", prompt="x", max_tokens=2)


# ---- batched prompts ---------------------------------------------------------------------------

def test_batched_prompts_one_choice_each_in_order(served, client, offline, tokenizer):
    prompts = ["The sky is", "Once upon a time", "1, 2, 3,"]
    expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    out = client.completions.create(model=NAMES[0], prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [e.outputs[0].text for e in expected]
    assert out.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert out.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=NAMES[0], prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [e.outputs[0].text for e in expected]


def test_batched_prompts_stream(served, client, offline):
    prompts = ["Red, green,", "Monday, Tuesday,", "a b c", "x"]
    expected = [e.outputs[0].text for e in offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
    chunks = list(client.completions.create(model=NAMES[0], prompt=prompts, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finishes = [""] * len(prompts), [0] * len(prompts)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finishes[choice.index] += choice.finish_reason is not None
    assert texts == expected and finishes == [1] * len(prompts)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= len(prompts)


def test_a_bad_prompt_in_a_batch_fails_the_batch_and_leaks_nothing(served):
    r = httpx.post(served.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": ["fine", "hello " * 400], "max_tokens": 2})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": ["fine", ""], "max_tokens": 2})
    assert r.status_code == 400 and "prompt 1" in r.json()["error"]["message"]
    wait_idle(served)                    # nothing left running or holding blocks


# ---- the command line --------------------------------------------------------------------------

def test_version_flag(capsys):
    import tinyvllm
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tinyvllm {tinyvllm.__version__}"


@pytest.mark.parametrize("args,message", [
    (["{model}", "--model", "/other"], "two models given"),
    ([], "no model given"),
    (["{model}", "--dtype", "float16"], "--dtype float16 is not supported on --device cpu"),
    (["{model}", "--allowed-origins", '["http://a"'], "--allowed-origins: invalid JSON list"),
    (["{model}", "--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization sizes the GPU"),
    (["{model}", "--chat-template", "/no/such/template.jinja"], "cannot read chat template file"),
])
def test_serve_argument_errors_are_one_line(tiny_model_dir, capsys, args, message):
    args = [a.replace("{model}", str(tiny_model_dir)) for a in args]
    assert main(["serve", "--device", "cpu", "--log-level", "warning", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_positional_model_sigterm_drains_and_exits_0(tiny_model_dir):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinyvllm", "serve", str(tiny_model_dir), "--device", "cpu",
         "--max-model-len", "256", "--port", str(port), "--served-model-name", "a", "b",
         "--allowed-origins", '["http://x.example"]', "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url, lines = f"http://127.0.0.1:{port}", []
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
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["a", "b"]
        # short enough to finish within the 5 s grace period even on a slow, busy CPU
        body = {"prompt": "Count slowly:", "max_tokens": 20, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            stream = r.iter_lines()
            lines.append(next(line for line in stream if line.startswith("data: ")))
            proc.send_signal(signal.SIGTERM)                     # mid-stream
            lines += [line for line in stream if line]          # the stream runs to its end
    finally:
        try:
            output = proc.communicate(timeout=60)[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, output
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"       # drained, not cut off
    assert "shutting down (SIGTERM)" in output and "server stopped" in output, output
    assert "parameters" in output and "maximum concurrency" in output, output   # engine log
    assert "Traceback" not in output, output
