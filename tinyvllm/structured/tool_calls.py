"""OpenAI tools for a model family: how the tools reach the prompt, the grammar that enforces
tool_choice "required" or a named function, and the parser that reads tool calls back out of
the generated text.

Two tool-call formats, chosen from the chat template (tool_format):
    llama3_json   Llama 3.x: the template takes `tools` and renders them itself; the model
                  answers with one JSON object {"name": ..., "parameters": {...}} (after an
                  optional <|python_tag|>; several separated by ";" are read too)
    hermes        Hermes / Qwen / SmolLM: each call is <tool_call>\\n{"name": ..., "arguments":
                  {...}}\\n</tool_call>, any text before the first one is the message's content.
                  A template that renders tools itself (it mentions <tool_call>) gets them as
                  `tools`; one that does not (SmolLM2's ChatML) gets them described in the
                  system message, the Hermes way (prompt_messages)

tool_choice "required" is a grammar of one or more calls (llama3_json: exactly one, the format
has one call per turn) to any of the tools, each call's arguments held to that function's
`parameters` schema; a named function is the same grammar with that one function and one call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tinyvllm.errors import InvalidRequestError
from tinyvllm.structured.params import StructuredOutputsParams

LLAMA3_JSON, HERMES = "llama3_json", "hermes"
PYTHON_TAG = "<|python_tag|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolFormat:
    name: str                       # LLAMA3_JSON or HERMES
    template_takes_tools: bool      # the chat template renders `tools` itself

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.name == LLAMA3_JSON else "arguments"


def tool_format(chat_template) -> ToolFormat:
    """The format of the model whose chat template this is (a ChatTemplate)."""
    text = chat_template.text
    takes = "tools" in chat_template.variables
    if takes and CALL_OPEN not in text and "<|start_header_id|>" in text:
        return ToolFormat(LLAMA3_JSON, True)
    return ToolFormat(HERMES, takes and CALL_OPEN in text)


def functions_of(tools) -> list[dict]:
    """OpenAI's tools ([{"type": "function", "function": {name, description, parameters}}]) ->
    the function dicts, checked (a missing parameters schema means no arguments)."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not re.fullmatch(r"[\w.\-]{1,64}", fn["name"]):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                      "with a name of letters, digits, _, . or - (at most 64)")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": params})
    names = [f["name"] for f in out]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tools name a function twice: {names}")
    return out


def prompt_messages(fmt: ToolFormat, messages: list[dict], functions: list[dict] | None) -> list[dict]:
    """The conversation as the template should see it. Assistant tool calls get their arguments
    as objects (templates render them with tojson). For a template that renders no tools, the
    tools go into the system message and past calls and results become text in the format."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"].get("arguments"))}}
                               for c in calls]
            if not fmt.template_takes_tools:
                text = "\n".join(f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                                "arguments": c["function"]["arguments"]}) + f"\n{CALL_CLOSE}"
                                 for c in m.pop("tool_calls"))
                m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        elif m.get("role") == "tool" and not fmt.template_takes_tools:
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if functions and not fmt.template_takes_tools:
        listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
        system = HERMES_SYSTEM.format(tools=listed)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _as_object(arguments):
    """OpenAI sends arguments as a JSON string; templates want the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def call_schema(fmt: ToolFormat, function: dict) -> dict:
    """The JSON schema of one call of `function` in this format."""
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             fmt.arguments_key: function["parameters"]},
            "required": ["name", fmt.arguments_key], "additionalProperties": False}


def tool_choice_constraint(fmt: ToolFormat, functions: list[dict], named: str | None = None) -> StructuredOutputsParams:
    """The grammar of tool_choice "required" (named None) or of the function `named`."""
    chosen = [f for f in functions if named is None or f["name"] == named]
    if not chosen:
        raise InvalidRequestError(f"tool_choice names function {named!r}, which is not among the tools")
    schemas = [call_schema(fmt, f) for f in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt.name == LLAMA3_JSON:
        return StructuredOutputsParams(json=schema)
    body = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
    calls = "call" if named is not None else "call (\"\\n\" call)*"
    return StructuredOutputsParams(grammar=f'start: {calls}\ncall: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\n'
                                           f"body: %json {body}")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str                  # a JSON object, as text (OpenAI's "arguments")


def parse_tool_calls(fmt: ToolFormat, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a generated message: no calls and the whole text as content when the
    text holds no well-formed call."""
    if fmt.name == LLAMA3_JSON:
        body = text.strip()
        body = body[len(PYTHON_TAG):].strip() if body.startswith(PYTHON_TAG) else body
        calls = [_call(part, "parameters") for part in _split_objects(body)] if body.startswith("{") else [None]
        if calls and all(calls):
            return None, calls
        return text, []
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    bodies = re.findall(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", text[start:], re.S)
    calls = [c for c in (_call(b.strip(), "arguments") for b in bodies) if c is not None]
    if not calls:
        return text, []
    return text[:start].strip() or None, calls


def _split_objects(body: str) -> list[str]:
    """`{...}; {...}` -> its objects' texts (one when there is no separator)."""
    try:
        json.loads(body)
        return [body]
    except json.JSONDecodeError:
        return [p.strip() for p in body.split(";") if p.strip()]


def _call(body: str, key: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        args = _as_object(args)
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
