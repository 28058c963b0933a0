"""The OpenAI request bodies we accept, and how each becomes (prompt, SamplingParams).

Pydantic models in strict mode: a string where a number belongs is a 400, not a silent
coercion. Fields that OpenAI/vLLM clients send by default (user, logprobs=null,
frequency_penalty=0, ...) are accepted; the same fields asking for a feature tinyvllm does not
have (logprobs=5, n=2, a non-zero penalty) are refused with a message naming the field, because
quietly ignoring them would return something the client did not ask for. Unknown fields are
ignored, as vLLM does."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import InvalidRequestError


class RequestValueError(InvalidRequestError):
    """An InvalidRequestError that knows which request field is at fault (the error body's
    `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
    top_k: Optional[int] = None                  # vLLM extension
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None   # vLLM extension
    ignore_eos: Optional[bool] = None            # vLLM extension
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    # Accepted only at their "off" values; see UNSUPPORTED_WHEN.
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[str] = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self._refuse_unsupported()
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
        )
        params.validate()
        return params

    @property
    def wants_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _refuse_unsupported(self) -> None:
        for name, is_off, why in UNSUPPORTED_WHEN:
            value = getattr(self, name, None)
            if value is not None and not is_off(value):
                raise RequestValueError(f"{name}={value!r} is not supported: {why}", param=name)


# (field, "value means the feature is off", reason). Only fields a model class declares are checked.
UNSUPPORTED_WHEN = (
    ("n", lambda v: v == 1, "tinyvllm returns exactly one choice per request (n=1)"),
    ("best_of", lambda v: v == 1, "only best_of=1 is supported"),
    ("echo", lambda v: v is False, "echo is not supported"),
    ("suffix", lambda v: v == "", "suffix (insertion) is not supported"),
    ("logprobs", lambda v: v is False or v == 0, "logprobs are not returned by tinyvllm"),
    ("top_logprobs", lambda v: v == 0, "logprobs are not returned by tinyvllm"),
    ("presence_penalty", lambda v: v == 0, "penalties are not implemented"),
    ("frequency_penalty", lambda v: v == 0, "penalties are not implemented"),
    ("logit_bias", lambda v: not v, "logit_bias is not implemented"),
    ("tools", lambda v: not v, "tool calling is not implemented"),
)


class CompletionRequest(_SamplingFields):
    # a string, token ids, or a batch of either (one choice per prompt, in order)
    prompt: Union[str, list[int], list[str], list[list[int]]]
    best_of: Optional[int] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    logprobs: Optional[int] = None

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "ipython"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

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
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None  # newer OpenAI name for max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise RequestValueError("max_tokens and max_completion_tokens disagree; send one",
                                        "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise RequestValueError("response_format other than text is not supported",
                                    "response_format")
        return super().sampling_params(default_max_tokens)

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]
