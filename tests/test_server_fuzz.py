"""The canary fuzz test: random request bodies — valid, boundary and invalid values of every field
of /v1/completions and /v1/chat/completions, streamed or not, unknown fields, wrong types, lone
surrogates, huge lists — sent to a live server (numpy backend, tiny preset) while a long greedy
*canary* request streams. Every fuzzed request gets a 200 or a 4xx, never a 5xx (nor an error
event inside a 200 stream), and every canary run's text equals its offline greedy text: no bad
request can hurt another one."""
from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_server import LiveServer  # noqa: E402

ENGINE_OPTIONS = dict(device="cpu", max_model_len=128)    # small: a chat request's default
VOCAB = 128256                                            # max_tokens fills the rest of it
CANARY_PROMPT = "The capital of France is"
CANARY_TOKENS = 64
EXAMPLES = 40                                             # per endpoint: ~60 s in all on a CPU
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
NAN, INF = float("nan"), float("inf")
SURROGATES = ["\ud800", "a\udfffb", "\udbff\udc00\ud800"]


# -- the server and the canary -------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    from tinyvllm.server.launch import ServeOptions, build_server
    app, engine_loop = build_server(ServeOptions(model=str(tiny_model_dir), served_model_names=("tiny",),
                                                 log_requests=False, engine_options=ENGINE_OPTIONS))
    with LiveServer(app) as live:
        live.engine_loop = engine_loop
        yield live


@pytest.fixture(scope="module")
def canary_text(tiny_model_dir):
    from tinyvllm.engine.llm import LLM
    from tinyvllm.engine.sampling_params import SamplingParams
    llm = LLM(str(tiny_model_dir), **ENGINE_OPTIONS)
    try:
        out = llm.generate([CANARY_PROMPT], SamplingParams(temperature=0.0, max_tokens=CANARY_TOKENS,
                                                             ignore_eos=True))[0].outputs[0]
    finally:
        llm.engine.close()
    assert len(out.token_ids) == CANARY_TOKENS
    return out.text


@dataclass
class Canary:
    """Greedy streamed completions, one after another until stopped, each text recorded."""
    url: str
    expected: str
    texts: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    fuzzed: dict = field(default_factory=lambda: {"completions": 0, "chat": 0})
    statuses: list = field(default_factory=list)

    def run(self):
        body = {"prompt": CANARY_PROMPT, "max_tokens": CANARY_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=300, trust_env=False) as client:
            while not self.stop.is_set():
                try:
                    events = sse_payloads(client, "/v1/completions", json.dumps(body).encode())
                    self.texts.append("".join(e["choices"][0]["text"] for e in events
                                              if isinstance(e, dict) and e.get("choices")))
                except Exception as e:     # noqa: BLE001 — recorded, asserted on at the end
                    self.errors.append(repr(e))


@pytest.fixture(scope="module")
def canary(fuzz_server, canary_text):
    c = Canary(fuzz_server.url, canary_text)
    thread = threading.Thread(target=c.run, daemon=True)
    thread.start()
    yield c
    c.stop.set()
    thread.join(300)


def sse_payloads(client, path: str, content: bytes) -> list:
    """A streamed request's data payloads, up to [DONE] (which must come)."""
    with client.stream("POST", path, content=content,
                       headers={"Content-Type": "application/json"}) as r:
        assert r.status_code == 200, r.read()
        payloads, done = [], False
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    done = True
                    break
                payloads.append(json.loads(line[6:]))
    assert done, "the stream ended without [DONE]"
    return payloads


# -- the bodies ----------------------------------------------------------------------------
# Every field: (a strategy of values that must be accepted, boundary and invalid values). A body
# is drawn in one of three modes: all valid (must be a 200), valid but one field drawn from its
# bad values (each bad value judged on its own: 200 or 4xx), or anything at all (200 or 4xx).

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
# Valid texts stay within Latin letters (at most 2 tokens a character), so a valid body always
# fits the 128-token context; any other character comes in the bad values and "anything" mode.
LATIN = st.characters(max_codepoint=0x2FF)
SMALL_TEXT = st.text(LATIN, max_size=12)
STOP = st.text(min_size=1, max_size=12)
WIDE = ["日本語のテキスト🙂" * 3, "\u0000\u200b\ufeff\U0010ffff", "\U0001F600" * 40]

SAMPLING_FIELDS = {
    "model": (st.just("tiny"), [None, "nope", "", 5, ["tiny"], *SURROGATES]),
    "max_tokens": (st.integers(1, 3), [0, -1, 127, 128, 2**31 - 1, 2**31, 2**63, 10**30, 1.5, "4",
                                       True, NAN, None]),
    "temperature": (st.floats(0, 2), [-1.0, -0.0, NAN, INF, -INF, 1e39, 1e308, "0.5", True, None, 2**70]),
    "top_p": (st.floats(0.01, 1), [0, -0.1, 1.1, 1e-45, NAN, INF, None, "1", 1]),
    "top_k": (st.sampled_from([-1]) | st.integers(1, 100),
              [-2, 0, 2**31 - 1, 2**31, 2**32, 2**63, -2**31, 1.0, "5", None]),
    "seed": (st.integers(0, 2**64 - 1), [-1, 2**64, 2**100, None, "1", 1.5, True]),
    "stop": (STOP | st.lists(STOP, max_size=4),
             [None, "", [], [""], ["a"] * 17, ["x"] * 100_000, "s" * 513, [5], [None], *SURROGATES,
              [SURROGATES[0]]]),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=8),
                       [[-1], [VOCAB], [2**31], [2**63], [1.5], ["1"], list(range(1025)),
                        list(range(100_000)), None, 5]),
    "ignore_eos": (st.booleans(), [None, "yes", 1, 0]),
    "n": (st.just(1), [2, 0, -1, 65, 2**31, None, "1", 1.0]),
    "stream": (st.booleans(), [None, "yes", 1]),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                       [None, {"include_usage": "x"}, 5, [], {"x": 1}]),
    "presence_penalty": (st.just(0), [0.5, -2, 2.5, NAN, None, "0"]),
    "frequency_penalty": (st.just(0.0), [0.5, -3, NAN, INF, None]),
    "repetition_penalty": (st.just(1.0), [0, -1, 1.2, NAN, INF, None]),
    "min_p": (st.just(0.0), [-0.1, 0.5, 1, 1.5, NAN, None, "0"]),
    "min_tokens": (st.just(0), [1, 4, -1, 2**31, None, "1"]),
    "logit_bias": (st.just({}), [None, {"5": 1}, {"5": 101}, {"-1": 1}, {str(VOCAB): 1}, {"x": "y"}, [1],
                                 {str(i): 1 for i in range(1100)}]),
    "user": (SMALL_TEXT, ["", 5, None, *SURROGATES]),
    "skip_special_tokens": (st.just(True), [False, None, "no"]),
    "include_stop_str_in_output": (st.just(False), [True, None, 1]),
}
COMPLETION_FIELDS = {
    "echo": (st.just(False), [None, True, 1]),
    "best_of": (st.just(1), [None, 2, 0]),
    "suffix": (st.just(""), [None, "x", 5]),
    "logprobs": (st.just(0), [None, False, 1, 5, 21, -1, "1"]),
}
CHAT_FIELDS = {
    "max_completion_tokens": (st.nothing(), [None, 0, 3, 2**31, -1, "3"]),
    "logprobs": (st.just(False), [None, True, 0, 1, "1"]),
    # vLLM refuses top_logprobs (even 0) unless logprobs is true: never in a valid body
    "top_logprobs": (st.nothing(), [None, 0, 1, 20, 21, -1]),
    "tools": (st.just([]), [None, [{"type": "function", "function": {"name": "f"}}], "x"]),
    "tool_choice": (st.nothing(), [None, "none", "auto", 5]),
    "response_format": (st.just({"type": "text"}), [None, {"type": "json_object"}, {"type": 5}, "text", []]),
}
VALID_PROMPT = st.one_of(
    st.text(LATIN, min_size=1, max_size=40),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
    st.lists(st.text(LATIN, min_size=1, max_size=16), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), min_size=1, max_size=3))
BAD_PROMPTS = ["", [], [[]], ["", "x"], [-1], [VOCAB], [2**31], [2**63], [1.5], [True], [[1], "x"],
               None, 5, {"a": 1}, ["x", 5], "x" * 5000, list(range(1000)), *SURROGATES, *WIDE, WIDE]
ROLES = ["system", "developer", "user", "assistant", "tool", "ipython"]
CONTENT = st.one_of(st.sampled_from([None, "", 5, [], [{"type": "image_url", "image_url": {"url": "x"}}],
                                     [{"type": "text"}], [{"type": "text", "text": 5}], {"text": "x"},
                                     *SURROGATES]),
                    st.text(max_size=24), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SMALL_TEXT}),
                                         max_size=3))
ANY_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": CONTENT},
                          optional={"name": st.sampled_from(["n", 5, SURROGATES[0]])}),
    st.sampled_from([{}, {"role": "robot", "content": "x"}, {"role": 5}, {"content": "x"}, "hi", 5, None]))
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": SMALL_TEXT}), min_size=1, max_size=3)
BAD_MESSAGES = [[], None, "hi", [1], {"role": "user"}, [{"role": "user", "content": SURROGATES[0]}],
                [{"role": "robot", "content": "x"}], [{"role": "user", "content": "x" * 5000}],
                [{"role": "user", "content": w} for w in WIDE]]
KNOWN = set(SAMPLING_FIELDS) | set(COMPLETION_FIELDS) | set(CHAT_FIELDS) | {"prompt", "messages"}
UNKNOWN = st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in KNOWN), JSON_VALUES,
                          max_size=3)


@st.composite
def bodies(draw, chat: bool):
    """-> (mode, body). The main field (prompt / messages) and max_tokens (without it a chat
    request fills the context: ~100 tokens of numpy decoding) are nearly always there; every
    other field with probability 1/4; up to three unknown fields."""
    fields = {**SAMPLING_FIELDS, **(CHAT_FIELDS if chat else COMPLETION_FIELDS)}
    main, valid_main, bad_main = (("messages", VALID_MESSAGES, BAD_MESSAGES) if chat
                                  else ("prompt", VALID_PROMPT, BAD_PROMPTS))
    mode = draw(st.sampled_from(["valid", "valid", "one bad field", "one bad field", "anything"]))
    if mode == "anything" and draw(st.integers(0, 9)) == 0:
        return mode, draw(st.sampled_from([[], "x", 5, None, [{"prompt": "x"}]]))
    chosen = [name for name in fields if name != "max_tokens" and draw(st.integers(0, 3)) == 0]
    body = {main: draw(valid_main), "max_tokens": draw(fields["max_tokens"][0])}
    for name in chosen:
        valid, _ = fields[name]
        if not valid.is_empty:
            body[name] = draw(valid)
    if mode == "one bad field":
        name = draw(st.sampled_from([main, *fields]))
        body[name] = draw(st.sampled_from(bad_main if name == main else fields[name][1]))
    elif mode == "anything":
        for name in [main, "max_tokens", *chosen]:
            if draw(st.integers(0, 2)) == 0:
                bad = bad_main if name == main else fields[name][1]
                body[name] = draw(st.sampled_from(bad))
        if draw(st.integers(0, 19)) == 0:
            del body[main]
        body.update(draw(UNKNOWN))
    return mode, body


# -- the checks ----------------------------------------------------------------------------

def encode(body) -> bytes:
    # ensure_ascii: a lone surrogate goes out as its \\ud800 escape (raw, it is no UTF-8 at all);
    # NaN and Infinity as Python's json writes them (and reads them back)
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def send_and_check(client, path: str, drawn) -> int:
    """One fuzzed request; -> its status, after checking it is a 200 or a well-formed 4xx (a
    valid body: a 200)."""
    mode, body = drawn
    content = encode(body)
    with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
        raw = r.read()
    text = raw.decode("utf-8", "replace")
    assert r.status_code < 500, f"{r.status_code} for {content[:600]!r}: {text[:600]}"
    assert "Traceback" not in text
    assert mode != "valid" or r.status_code == 200, f"{r.status_code} for {content[:600]!r}: {text[:600]}"
    if r.status_code >= 400:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"], text
        return r.status_code
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        assert lines and lines[-1] == "[DONE]", text[-300:]
        for data in lines[:-1]:
            assert "error" not in json.loads(data), f"error event for {content[:600]!r}: {data}"
    else:
        assert json.loads(raw)["choices"], text
    return 200


@pytest.fixture(scope="module")
def client(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=300, trust_env=False) as c:
        yield c


@FUZZ
@given(body=bodies(chat=False))
def test_fuzzed_completions_get_200_or_4xx(canary, client, body):
    canary.statuses.append(send_and_check(client, "/v1/completions", body))
    canary.fuzzed["completions"] += 1


@FUZZ
@given(body=bodies(chat=True))
def test_fuzzed_chat_completions_get_200_or_4xx(canary, client, body):
    canary.statuses.append(send_and_check(client, "/v1/chat/completions", body))
    canary.fuzzed["chat"] += 1


@pytest.mark.parametrize("path, main", [("/v1/completions", {"prompt": "Hello"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
@pytest.mark.parametrize("stream", [False, True])
def test_top_k_past_int32_is_a_400_naming_top_k(canary, client, path, main, stream):
    r = client.post(path, json={**main, "top_k": 2147483648, "max_tokens": 4, "stream": stream})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "top_k" and "top_k" in error["message"] and "2147483647" in error["message"]


def test_the_canary_was_untouched(canary):
    """Last in this module: the canary runs that overlapped all of the above, every one exact."""
    runs_before = len(canary.texts)
    # one more whole run after the fuzzing, so at least one started while fuzzed requests ran
    while len(canary.texts) <= runs_before and not canary.errors:
        canary.stop.wait(0.1)
    canary.stop.set()
    total = sum(canary.fuzzed.values())
    print(f"fuzz: {canary.fuzzed['completions']} completion and {canary.fuzzed['chat']} chat bodies "
          f"({total} examples; statuses {dict(sorted(Counter(canary.statuses).items()))}); "
          f"canary: {len(canary.texts)} greedy runs of {CANARY_TOKENS} tokens")
    assert not canary.errors, canary.errors[:3]
    assert total >= 2 * EXAMPLES * 0.9          # hypothesis ran (nearly) every example
    assert canary.texts and all(t == canary.expected for t in canary.texts), \
        [t[:80] for t in canary.texts if t != canary.expected][:3]

