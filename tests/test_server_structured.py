"""Structured outputs, tools, GET /v1/models/{id} and the Responses API through the server, end
to end on the numpy backend with the random-weight tiny model (Llama 3 tokenizer and template),
driven by the official openai client: whatever the weights, schema-constrained output validates
(jsonschema) and a required tool call's arguments validate against the tool's parameters."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

from test_server import LiveServer  # noqa: E402

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "stops": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["city", "days", "stops"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
                                                          "required": ["tz"], "additionalProperties": False}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Plan a trip"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from tinyvllm.server.launch import ServeOptions, build_server
    app, _ = build_server(ServeOptions(model=str(tiny_model_dir), served_model_names=(MODEL,),
                                       engine_options=dict(device="cpu", max_model_len=1024)))
    with LiveServer(app) as live:
        live.engine = app.state.engine_loop.engine
        yield live


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates_for_every_seed(client, stream):
    for seed in range(4):
        kw = dict(model=MODEL, messages=USER, max_tokens=80, seed=seed, temperature=1.0,
                  response_format=json_schema_format(SCHEMA))
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            text, finish = choice.message.content, [choice.finish_reason]
        assert finish == ["stop"], (text, finish)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_response_format_and_vllm_extras(client):
    out = client.completions.create(model=MODEL, prompt="Data:", max_tokens=80, seed=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    for extra, check in [({"guided_regex": r"[A-Z]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[A-Z]{3}-[0-9]{2}", t)),
                         ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                         ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
                         ({"guided_grammar": 'start: "n=" /[0-9]/'}, lambda t: re.fullmatch("n=[0-9]", t)),
                         ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down"))]:
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=80, seed=1, extra_body=extra)
        assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), (extra, out.choices[0].text)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": json_schema_format({"type": "wat"})}, "response_format", "cannot be compiled"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "cannot be compiled"),
    ({"extra_body": {"guided_json": SCHEMA, "guided_regex": "a"}}, "guided_regex", "one output constraint"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object or json_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_constraints_are_one_400_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, **body)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_gives_a_call_whose_arguments_validate(client, stream):
    for seed in range(3):
        kw = dict(model=MODEL, messages=USER, max_tokens=80, seed=seed, tools=TOOLS, tool_choice="required")
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kw):
                delta = chunk.choices[0].delta
                assert not delta.content, "a required call sends no content"
                for tc in delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            got = list(calls.values())
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            finish = choice.finish_reason
            got = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
            assert all(c.id and c.type == "function" for c in choice.message.tool_calls)
        assert finish == "tool_calls" and len(got) == 1
        jsonschema.validate(json.loads(got[0]["arguments"]), PARAMETERS[got[0]["name"]])


def test_named_tool_choice_and_a_tool_round_trip(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, seed=5, tools=TOOLS,
                                            tool_choice=named).choices[0]
    call, = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == "stop"       # vLLM's for a named choice
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_time"])
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    out = client.chat.completions.create(model=MODEL, messages=history, max_tokens=5, tools=TOOLS, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, tools=TOOLS, tool_choice="none",
                                          temperature=0, extra_body={"ignore_eos": True})
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


def test_tools_reach_the_template(served):
    """The Llama 3.2 template lists the tools (in the first user message)."""
    from tinyvllm.server.structured_request import chat_messages, tool_plan
    tok = served.engine.tokenizer
    plan = tool_plan(TOOLS, "auto", tok.chat_template)
    assert plan.format.name == "llama3_json" and plan.template_tools
    text = tok.apply_chat_template(chat_messages(plan, USER, tok.chat_template), tools=plan.template_tools)
    assert '"name": "get_weather"' in text and "Plan a trip" in text


def test_models_retrieve_and_404(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_responses_text_schema_tool_and_stream(client):
    out = client.responses.create(model=MODEL, input="Say something", instructions="Be brief", max_output_tokens=6,
                                  temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text and out.usage.output_tokens == 6
    fmt = {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}
    out = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Trip?"}]}],
                                  max_output_tokens=80, text={"format": fmt})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    out = client.responses.create(model=MODEL, input="Weather?", max_output_tokens=80, tools=flat, tool_choice="required")
    call, = [o for o in out.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    follow = client.responses.create(model=MODEL, max_output_tokens=4, tools=flat, input=[
        {"role": "user", "content": "Weather?"}, call.model_dump(include={"type", "call_id", "name", "arguments"}),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete")
    events = list(client.responses.create(model=MODEL, input="Trip?", max_output_tokens=80, stream=True,
                                          text={"format": fmt}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and kinds.index("response.output_text.done") < kinds.index("response.completed")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_refuses_what_it_cannot_honour(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools"
