"""Chat templates: a checkpoint's own Jinja template, rendered the way transformers renders it.

transformers' apply_chat_template compiles the template in jinja2's ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, gives it `raise_exception`, `strftime_now` and a `tojson`
that keeps non-ASCII text, and renders it with `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's special tokens (`bos_token`, `eos_token`, ...). The
same here, so the prompt text, and so its token ids, are transformers' own.

Where the template comes from, first found wins:
  1. explicit: `--chat-template FILE`, LLM(..., chat_template=) or LLM.chat(..., chat_template=)
     (a file path, or the template text itself when it contains "{{" or "{%");
  2. chat_template.jinja in the model directory (what transformers >= 4.43 writes);
  3. "chat_template" in tokenizer_config.json: a string, or a list of {"name", "template"} of
     which the one named "default" is used.
A directory with none of these gets LLAMA3_FALLBACK, a plain Llama 3 format, with a warning, but
only if its vocabulary has Llama 3's header tokens; otherwise chat requests are refused.

Message content may be a string or a list of OpenAI content parts ({"type": "text", "text"}).
Templates that treat content as a string get the text parts joined with "\\n", as vLLM does;
templates that loop over `message['content']` get the parts themselves.

Errors: a syntax error is a ModelLoadError when the template is loaded; raise_exception() and any
failure while rendering (a missing field used in an expression, a sandbox violation) are one
InvalidRequestError. As in transformers, a missing variable merely printed renders as "".
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tinyvllm.errors import InvalidRequestError, ModelLoadError

log = logging.getLogger("tinyvllm")

TEMPLATE_DIR = Path(__file__).parent / "templates"
LLAMA32_INSTRUCT_FILE = TEMPLATE_DIR / "llama-3.2-instruct.jinja"   # Meta's Llama 3.2 Instruct template
# Used only for directories that carry no template at all (see the module docstring): each
# message as <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> after one
# <|begin_of_text|>, then an open assistant header.
LLAMA3_FALLBACK = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
LLAMA3_HEADER_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")


class _TemplateRaised(Exception):
    """raise_exception() called by the template: its message is the user's error."""


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters and returns Markup; transformers' is plain json
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it (for
    training masks); for inference it renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template and where it came from (named in every error)."""

    def __init__(self, text: str, source: str, special_tokens: dict[str, str] | None = None):
        if not isinstance(text, str) or not text.strip():
            raise ModelLoadError(f"{source}: the chat template is empty or not a string")
        self.text, self.source = text, source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(text)
            self.content_as_parts = _loops_over_content(_environment().parse(text))
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"{source}: chat template syntax error at line {e.lineno}: {e.message}") from None

    @property
    def variables(self) -> frozenset[str]:
        """The variables the template reads from its context (`tools` for one that renders
        tools itself: structured/tool_calls.py)."""
        import jinja2.meta
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(self.text)))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               documents: list | None = None, **template_kwargs) -> str:
        """The prompt text for `messages`. Extra keywords reach the template as variables (and
        override the special tokens), as in transformers (e.g. date_string= for Llama 3.2)."""
        context = {**self.special_tokens, **template_kwargs}
        try:
            return self._template.render(messages=self._normalize(messages), tools=tools,
                                         documents=documents, add_generation_prompt=add_generation_prompt,
                                         **context)
        except _TemplateRaised as e:
            raise InvalidRequestError(f"the chat template refused the conversation: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InvalidRequestError(f"chat template ({self.source}) failed on this conversation: "
                                      f"{type(e).__name__}: {e}") from None

    def _normalize(self, messages) -> list[dict]:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("a conversation must be a non-empty list of messages")
        out = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequestError(f"message {i} must be a dict with a string 'role', got {message!r}")
            # transformers drops None-valued keys (OpenAI clients send content=None, tool_calls=None)
            message = {k: v for k, v in message.items() if v is not None}
            content = message.get("content")
            if isinstance(content, (list, tuple)):
                parts = [_text_part(part, i) for part in content]
                message["content"] = list(content) if self.content_as_parts else "\n".join(parts)
            elif content is None:
                if not self.content_as_parts:
                    message["content"] = ""        # as vLLM renders a message without content
            elif not isinstance(content, str):
                raise InvalidRequestError(f"message {i}: 'content' must be a string or a list of "
                                          f"text parts, got {type(content).__name__}")
            out.append(message)
        return out


def _text_part(part, index: int) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequestError(f"message {index}: content part {kind!r} is not supported "
                              "(only {\"type\": \"text\", \"text\": ...})")


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """Does the template iterate over a message's content (`for part in message['content']`,
    directly or through a variable set from it)? Such templates expect content parts."""
    def is_content(node) -> bool:
        return (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == "content") or \
               (isinstance(node, jinja2.nodes.Getattr) and node.attr == "content")
    aliases = {a.target.name for a in ast.find_all(jinja2.nodes.Assign)
               if isinstance(a.target, jinja2.nodes.Name) and is_content(a.node)}
    return any(is_content(loop.iter) or (isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in aliases)
               for loop in ast.find_all(jinja2.nodes.For))


def special_tokens(tokenizer_config: dict) -> dict[str, str]:
    """bos_token, eos_token, ... as strings, as transformers' special_tokens_map gives them to
    the template (tokenizer_config.json writes each as a string or an AddedToken dict)."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        token = tokenizer_config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            out[key] = token
    return out


def _looks_like_template(text: str) -> bool:
    return "{{" in text or "{%" in text


def read_explicit(template: str | Path) -> tuple[str, str]:
    """(text, source) of an explicitly given template: a file path or the template itself."""
    if isinstance(template, str) and _looks_like_template(template):
        return template, "the given chat template"
    path = Path(template)
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read chat template file {path}: {e.strerror or e}") from None


def find_template(model_dir: Path, tokenizer_config: dict) -> tuple[str, str] | None:
    """(text, source) of the directory's own template, or None (lookup steps 2 and 3)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    source = str(model_dir / "tokenizer_config.json")
    template = tokenizer_config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, str):
        return template, source
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" in named and isinstance(named["default"], str):
            return named["default"], f"{source} (template 'default')"
        raise ModelLoadError(f"{source}: chat_template lists templates {sorted(map(str, named))} but none "
                             "named 'default'; pass one with --chat-template")
    raise ModelLoadError(f"{source}: chat_template must be a string or a list of "
                         f"{{'name', 'template'}}, got {type(template).__name__}")


_warned_fallback: set[str] = set()


def load_chat_template(model_dir: str | Path, tokenizer_config: dict, vocab: dict[str, int],
                       explicit: str | Path | None = None) -> ChatTemplate | None:
    """The template for this model directory by the lookup order above; None when there is
    none and the Llama 3 fallback does not fit the vocabulary."""
    model_dir = Path(model_dir)
    tokens = special_tokens(tokenizer_config)
    found = read_explicit(explicit) if explicit is not None else find_template(model_dir, tokenizer_config)
    if found is not None:
        return ChatTemplate(*found, special_tokens=tokens)
    if not all(t in vocab for t in LLAMA3_HEADER_TOKENS):
        return None
    if str(model_dir) not in _warned_fallback:
        _warned_fallback.add(str(model_dir))
        log.warning("%s has no chat template (no chat_template.jinja, no chat_template in "
                    "tokenizer_config.json): using the plain Llama 3 chat format; pass "
                    "--chat-template FILE if the model was trained on another", model_dir)
    return ChatTemplate(LLAMA3_FALLBACK, "tinyvllm's Llama 3 fallback format", special_tokens=tokens)
