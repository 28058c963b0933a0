"""A request's output constraint and tools, from the fields OpenAI and vLLM clients send:

    response_format     {"type": "text"} (none), {"type": "json_object"}, {"type": "json_schema",
                        "json_schema": {"name", "schema", "strict"}}: chat and completions
    text.format         the Responses API's: {"type": "json_schema", "name", "schema", "strict"}
    structured_outputs  vLLM's extra: {"json" | "regex" | "choice" | "grammar" | "json_object",
                        "disable_any_whitespace"}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older extras
    tools, tool_choice  "none", "auto", "required", {"type": "function", "function": {"name"}}

At most one constraint per request: two of the above (or a forcing tool_choice beside a schema)
is a 400 naming both. `strict` is accepted either way: the constraint is always enforced.
ToolPlan is what a chat request with tools does: the tools handed to the template, the grammar
of a required or named choice, and the parser of the output (structured/tool_calls.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.errors import InvalidRequestError, RequestValueError
from tinyvllm.structured import StructuredOutputsParams as SO
from tinyvllm.structured import tool_calls as T

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def _made(param: str, **kw) -> SO:
    try:
        return SO(**kw)
    except InvalidRequestError as e:
        raise RequestValueError(str(e).replace("structured_outputs", param, 1), param) from None


def response_format_constraint(rf, param: str = "response_format") -> SO | None:
    """OpenAI's response_format (chat, completions) -> the constraint, None for text."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _made(param, json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestValueError(f"{param}: type json_schema needs json_schema.schema, a JSON schema object", param)
        return _made(param, json=spec["schema"])
    raise RequestValueError(f"{param}: type must be text, json_object or json_schema, got {kind!r}", param)


def text_format_constraint(fmt) -> SO | None:
    """The Responses API's text.format (the schema beside the type, not under json_schema)."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestValueError("text.format: type json_schema needs schema, a JSON schema object", "text")
        return _made("text.format", json=fmt["schema"])
    return response_format_constraint(fmt, "text.format")


def request_constraint(body) -> SO | None:
    """The one constraint of a chat / completions body, from whichever field sets it."""
    found: dict[str, SO] = {}
    rf = response_format_constraint(getattr(body, "response_format", None))
    if rf is not None:
        found["response_format"] = rf
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict) or set(so) - set(SO_FIELDS):
            raise RequestValueError(f"structured_outputs must be an object with some of {', '.join(SO_FIELDS)}",
                                    "structured_outputs")
        found["structured_outputs"] = _made("structured_outputs", **so)
    for name, kind in GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found[name] = _made(name, **{kind: value})
    if len(found) > 1:
        raise RequestValueError(f"a request takes one output constraint; got {' and '.join(found)}", list(found)[1])
    return next(iter(found.values()), None)


@dataclass(frozen=True)
class ToolPlan:
    format: T.ToolFormat
    functions: list[dict]
    choice: str                      # "auto", "required" or "named"
    named: str | None = None

    @property
    def constraint(self) -> SO | None:
        if self.choice == "auto":
            return None
        return T.tool_choice_constraint(self.format, self.functions, self.named)

    @property
    def template_tools(self) -> list[dict] | None:
        """What the template's `tools` gets (None where the tools went into the messages)."""
        if not self.format.template_takes_tools:
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def messages(self, messages: list[dict]) -> list[dict]:
        return T.prompt_messages(self.format, messages, self.functions)

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason of a choice that called tools (vLLM's: "stop" for a named one)."""
        return "stop" if self.choice == "named" else "tool_calls"

    def parse(self, text: str) -> tuple[str | None, list[T.ParsedCall]]:
        return T.parse_tool_calls(self.format, text)


def tool_plan(tools, tool_choice, chat_template, param: str = "tools") -> ToolPlan | None:
    """None when the request has no tools or tool_choice is "none" (the tools are then left out
    of the prompt and nothing is parsed)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise RequestValueError("tool_choice needs tools", "tool_choice")
        return None
    if chat_template is None:
        raise RequestValueError("tools need a chat template; this model has none", param)
    try:
        functions = T.functions_of(tools)
    except InvalidRequestError as e:
        raise RequestValueError(str(e), param) from None
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    fmt = T.tool_format(chat_template)
    if choice in ("auto", "required"):
        return ToolPlan(fmt, functions, choice)
    name = _named(choice)
    if name not in {f["name"] for f in functions}:
        raise RequestValueError(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    return ToolPlan(fmt, functions, "named", name)


def _named(choice) -> str | None:
    """{"type": "function", "function": {"name"}} (chat) or {"type": "function", "name"} (Responses)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if isinstance(name, str):
            return name
    raise RequestValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', "tool_choice")


def chat_messages(plan: ToolPlan | None, messages: list[dict], chat_template) -> list[dict]:
    """The conversation for the template: with the plan's tools, or (tools absent or "none")
    with any past tool calls and results put in the model's format all the same."""
    if plan is not None:
        return plan.messages(messages)
    if chat_template is not None and any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return T.prompt_messages(T.tool_format(chat_template), messages, None)
    return messages


def constraint_field(body) -> str | None:
    """The request field an output constraint came from (a 400's `param`)."""
    for name in ("response_format", "structured_outputs", *GUIDED, "text"):
        value = getattr(body, name, None)
        if value is not None and value != {"type": "text"}:
            return name
    return "tool_choice" if getattr(body, "tool_choice", None) not in (None, "auto", "none") else None


class RequestPreparer:
    """What the chat-shaped routes (chat completions, the Responses API) do before the engine:
    the template with the tools, the context check, the SamplingParams, and the constraint
    compiled on a worker thread (cached for the engine's add_request), so that one the library
    cannot compile is a 400 naming its field before anything is queued."""

    def __init__(self, engine, encoder, prompt_ids_of_chat, context_limit: int):
        self.engine, self.encoder = engine, encoder
        self.prompt_ids_of_chat, self.context_limit = prompt_ids_of_chat, context_limit

    async def check_constraint(self, params, body) -> None:
        if params.structured_outputs is not None:
            try:
                await self.encoder.run(self.engine.structured.grammar, params.structured_outputs)
            except InvalidRequestError as e:
                field = constraint_field(body)
                message = str(e).replace(f"structured_outputs.{params.structured_outputs.kind}", field or "the constraint", 1)
                raise RequestValueError(message, field) from None

    async def chat(self, body, messages: list[dict], tools, tool_choice):
        """-> (prompt ids, SamplingParams, ToolPlan or None). max_tokens defaults to the
        context left after the conversation, as vLLM's."""
        template = self.engine.tokenizer.chat_template
        plan = tool_plan(tools, tool_choice, template)
        messages = chat_messages(plan, messages, template)
        prompt_ids = await self.encoder.chat(self.prompt_ids_of_chat, messages, True, False,
                                             plan.template_tools if plan else None)
        room = self.context_limit - len(prompt_ids)
        if room < 1:
            raise RequestValueError(f"the conversation is {len(prompt_ids)} tokens; this model's "
                                    f"context is {self.context_limit}", "messages")
        params = body.sampling_params(default_max_tokens=room, defaults=self.engine.default_sampling_fields,
                                      tool_constraint=plan.constraint if plan else None)
        await self.check_constraint(params, body)
        return prompt_ids, params, plan
