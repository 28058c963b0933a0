"""StructuredOutputsParams: the constraint a request's output must satisfy, in vLLM's shape.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))

Exactly one kind per request:
    json            a JSON schema (a dict, or its JSON text): the output is one JSON value
                    that validates against it
    regex           the whole output matches this regular expression (Rust regex syntax)
    choice          the output is exactly one of these strings
    grammar         a context-free grammar: Lark syntax, or GBNF (llama.cpp's) which is
                    converted to Lark
    json_object     any JSON object (OpenAI's response_format {"type": "json_object"})

disable_any_whitespace: JSON output without whitespace between its tokens (`{"a":1}`). True by
default here, where vLLM's default is False: a small model given free whitespace tends to
spend its whole budget on it. False allows JSON whitespace anywhere it is legal.

Frozen and validated when made: a bad value is one InvalidRequestError naming the field. Whether
the library can compile the constraint is checked when the request is added (structured/
grammar.py), where the tokenizer is known.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tinyvllm.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self):
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict:
        """The JSON schema of a json or json_object constraint."""
        if self.json_object:
            return {"type": "object"}
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def validate(self) -> StructuredOutputsParams:
        def bad(name, why):
            raise InvalidRequestError(f"invalid structured_outputs.{name}={_short(getattr(self, name))}: {why}")

        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar or json_object; "
                + (f"got {', '.join(given)}" if given else "got none"))
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    bad("json", f"not valid JSON ({e})")
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                bad("json", "must be a JSON schema: an object (or its JSON text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            bad("regex", "must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            bad("choice", "must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            bad("grammar", "must be a non-empty string (Lark or GBNF)")
        if self.json_object not in (None, True, False):
            bad("json_object", "must be true or false")
        if not isinstance(self.disable_any_whitespace, bool):
            bad("disable_any_whitespace", "must be true or false")
        return self


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
