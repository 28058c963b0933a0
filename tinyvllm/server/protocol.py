"""The OpenAI request bodies we accept, and how each becomes (prompt, SamplingParams).

Pydantic models in strict mode: a string where a number belongs is a 400, not a silent
coercion. Every OpenAI field and vLLM's extra sampling fields map onto SamplingParams (docs/
engine.md's table); output constraints (response_format, vLLM's structured_outputs and guided_*
extras) and tools go through server/structured_request.py; the OpenAI/vLLM fields asking for a
feature tinyvllm does not have (beam search, suffix, ...) are accepted at their "off" values only and
otherwise refused with a message naming the field, because quietly ignoring them would return
something the client did not ask for. Unknown fields are ignored, as vLLM does."""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import InvalidRequestError, RequestValueError
from tinyvllm.server.structured_request import request_constraint


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: Optional[bool] = None


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(strict=True, extra="ignore")

    model: Optional[str] = None                  # None: the server's first served model name
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None    # JSON keys are strings: token ids
    user: Optional[str] = None
    # vLLM's extra sampling fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    # vLLM fields tinyvllm does not have: accepted only at their "off" values (UNSUPPORTED_WHEN)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    spaces_between_special_tokens: Optional[bool] = None
    prompt_logprobs: Optional[int] = None
    # output constraints (server/structured_request.py): one of these at most
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def sampling_params(self, default_max_tokens: int, defaults: dict | None = None,
                        tool_constraint=None) -> SamplingParams:
        """The request's SamplingParams: the fields it sets, else `defaults` (the model's
        generation_config.json, LLMEngine.default_sampling_fields), else SamplingParams'. A
        max_tokens above `default_max_tokens` when that is the context left is refused by the
        caller (chat: ChatCompletionRequest; completions: serving.check_context).
        tool_constraint: the grammar of a required or named tool_choice (ToolPlan.constraint)."""
        self._refuse_unsupported()
        constraint = request_constraint(self)
        if tool_constraint is not None:
            if constraint is not None:
                raise RequestValueError("a required or named tool_choice is itself an output constraint; "
                                        "it cannot be combined with response_format or structured outputs",
                                        "tool_choice")
            constraint = tool_constraint
        fields = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        default_max = min(default_max_tokens, (defaults or {}).get("max_tokens", default_max_tokens))
        for name in ("temperature", "top_p", "top_k", "seed", "stop", "n", "presence_penalty",
                     "frequency_penalty", "min_p", "repetition_penalty", "min_tokens",
                     "include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.stop_token_ids is not None:
            fields["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            fields["logit_bias"] = self._logit_bias()
        fields["max_tokens"] = default_max if self.max_tokens is None else self.max_tokens
        fields.update(self._logprob_fields())
        if constraint is not None:
            fields["structured_outputs"] = constraint
        try:
            return SamplingParams(**fields)
        except InvalidRequestError as e:       # name the field for the error body's `param`
            name = next((f for f in fields if f"parameter {f}=" in str(e)), None)
            raise RequestValueError(str(e), param=name) from None

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise RequestValueError(f"logit_bias key {key!r} is not a token id (an integer)",
                                        "logit_bias") from None
            bias[token] = value
        return bias

    def _logprob_fields(self) -> dict:
        return {}

    @property
    def wants_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    HONOURED: ClassVar[tuple[str, ...]] = ()      # fields of UNSUPPORTED_WHEN this endpoint does serve

    def _refuse_unsupported(self) -> None:
        for name, is_off, why in UNSUPPORTED_WHEN:
            if name in self.HONOURED:
                continue
            value = getattr(self, name, None)
            if value is not None and not is_off(value):
                raise RequestValueError(f"{name}={value!r} is not supported: {why}", param=name)


# (field, "value means the feature is off", reason). Only fields a model class declares are checked.
UNSUPPORTED_WHEN = (
    ("suffix", lambda v: v == "", "suffix (insertion) is not supported"),
    ("use_beam_search", lambda v: v is False, "beam search is not implemented"),
    ("length_penalty", lambda v: v == 1, "length_penalty applies to beam search, which is not implemented"),
    ("allowed_token_ids", lambda v: not v, "allowed_token_ids is not implemented"),
    ("bad_words", lambda v: not v, "bad_words is not implemented"),
    ("truncate_prompt_tokens", lambda v: False, "prompt truncation is not implemented"),
    ("spaces_between_special_tokens", lambda v: v is True, "special tokens are always joined as the "
                                                            "tokenizer decodes them"),
    ("echo", lambda v: v is False, "echo is supported on /v1/completions only"),
)


class CompletionRequest(_SamplingFields):
    # a string, token ids, or a batch of either (n choices per prompt, in order)
    prompt: Union[str, list[int], list[str], list[list[int]]]
    best_of: Optional[int] = None
    echo: Optional[bool] = None                  # the prompt before each choice's text
    HONOURED: ClassVar[tuple[str, ...]] = ("echo",)
    suffix: Optional[str] = None
    logprobs: Optional[int] = None               # top-k per token (0: the sampled one only)

    def _refuse_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestValueError(f"best_of={self.best_of!r} is not supported: only best_of=n "
                                    "(all samples are returned)", "best_of")
        super()._refuse_unsupported()

    def _logprob_fields(self) -> dict:
        out = {}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        if self.echo and self.logprobs is not None:     # echo's prompt tokens carry logprobs too
            out["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return out

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, one in enumerate(batch):
            if len(one) == 0:
                raise RequestValueError("prompt is empty" if len(batch) == 1
                                        else f"prompt {i} of the batch is empty", "prompt")
        return batch


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str                                   # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "ipython"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None      # an assistant's calls ...
    tool_call_id: Optional[str] = None               # ... and a tool message's answer to one

    def as_template_message(self) -> dict:
        """The message as the chat template sees it; text parts stay parts (the template module
        joins them for templates that expect a string, as vLLM does)."""
        content = self.content
        if isinstance(content, list):
            content = [{"type": "text", "text": part.text} for part in content]
        # "developer" is OpenAI's newer name for the system role.
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None  # newer OpenAI name for max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    echo: Optional[bool] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None

    def sampling_params(self, default_max_tokens: int, defaults: dict | None = None,
                        tool_constraint=None) -> SamplingParams:
        """default_max_tokens: the context left after the conversation (a larger max_tokens is
        a 400, as in vLLM)."""
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise RequestValueError("max_tokens and max_completion_tokens disagree; send one",
                                        "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        if self.max_tokens is not None and self.max_tokens > default_max_tokens:
            raise RequestValueError(context_error(default_max_tokens, self.max_tokens), "max_tokens")
        return super().sampling_params(default_max_tokens, defaults, tool_constraint)

    def _logprob_fields(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestValueError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.prompt_logprobs is not None:
            raise RequestValueError("prompt_logprobs is not returned by /v1/chat/completions",
                                    "prompt_logprobs")
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]


def context_error(room: int, max_tokens: int, context_limit: int | None = None,
                  prompt_tokens: int | None = None) -> str:
    """vLLM's 400 for a max_tokens above the context left."""
    if context_limit is None:
        return (f"max_tokens={max_tokens} is more than the {room} tokens left in this model's "
                "maximum context length after the messages. Please reduce the length of the "
                "messages or completion.")
    return (f"This model's maximum context length is {context_limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion.")
