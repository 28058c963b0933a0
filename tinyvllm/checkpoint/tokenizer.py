"""Text <-> token ids: a thin layer over the `tokenizers` package (tokenizer.json), the model's
chat template (checkpoint/chat_template.py), and streaming detokenization.

Special tokens follow the tokenizer, as in transformers and vLLM: a raw prompt is encoded with
add_special_tokens=True, so tokenizer.json's post-processor decides whether a BOS is added
(Llama 3's adds <|begin_of_text|>, SmolLM2's adds nothing); config.json's bos_token_id is never
used for that. A rendered chat template is encoded with add_special_tokens=False, because the
template writes its own BOS. One deliberate difference from transformers: a raw prompt whose
text already starts (or ends) with the very token the post-processor adds gets it once, not twice.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tinyvllm.checkpoint.chat_template import ChatTemplate, load_chat_template, read_explicit
from tinyvllm.config import ModelConfig
from tinyvllm.errors import InvalidRequestError, ModelLoadError

try:
    from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21
except ImportError:
    DecodeStream = None

REPLACEMENT_CHAR = "\ufffd"     # what decoding yields for an incomplete UTF-8 sequence


class Tokenizer:
    def __init__(self, backend, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: ChatTemplate | None = None, source: str = "tokenizer"):
        self.backend = backend                  # a tokenizers.Tokenizer
        self.bos_token_id = bos_token_id        # informational; encode() follows the post-processor
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template      # None: the directory has no usable template
        self.source = source

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: ModelConfig | None = None,
                        chat_template: str | Path | None = None) -> Tokenizer:
        """Load tokenizer.json and the chat template from a model directory. End-of-sequence ids
        are the union of those named by config.json (or `config`), generation_config.json and
        tokenizer_config.json: Instruct models end turns with <|eot_id|> but list others too.
        chat_template: a template (file path or text) to use instead of the directory's own."""
        from tokenizers import Tokenizer as Backend
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir} has no tokenizer.json (tinyvllm reads the fast-tokenizer "
                                 "format; a tokenizer.model alone is not enough)")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ModelLoadError(f"{path}: cannot load tokenizer ({e})") from None

        model_cfg = _read_json(model_dir / "config.json")
        generation_cfg = _read_json(model_dir / "generation_config.json")
        tokenizer_cfg = _read_json(model_dir / "tokenizer_config.json")

        def token_id(token) -> int | None:
            text = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(text) if isinstance(text, str) else None

        eos: set[int] = set(config.eos_token_ids) if config else set(_as_ids(model_cfg.get("eos_token_id")))
        eos |= set(_as_ids(generation_cfg.get("eos_token_id")))
        if token_id(tokenizer_cfg.get("eos_token")) is not None:
            eos.add(token_id(tokenizer_cfg["eos_token"]))
        bos = token_id(tokenizer_cfg.get("bos_token"))
        if bos is None:
            bos = config.bos_token_id if config else model_cfg.get("bos_token_id")
        template = load_chat_template(model_dir, tokenizer_cfg, backend.get_vocab(with_added_tokens=True),
                                      explicit=chat_template)
        return cls(backend, bos, tuple(sorted(eos)), template, str(model_dir))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text (<|eot_id|> ...) become their ids. With
        add_special_tokens, tokenizer.json's post-processor adds what the model expects (a BOS
        for Llama 3), except a token the text itself already starts or ends with."""
        # encode_batch of one text, not encode(): the same encoding, but it releases the GIL
        # while it works, so a server thread encoding a huge prompt stalls no other thread
        encoding = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        ids = encoding.ids
        if not add_special_tokens:
            return ids
        added = [s is None for s in encoding.sequence_ids]       # tokens the post-processor put in
        lead = next((i for i, a in enumerate(added) if not a), len(ids))
        tail = next((i for i, a in enumerate(reversed(added)) if not a), 0) if lead < len(ids) else 0
        end = len(ids) - tail
        if lead and ids[lead:2 * lead] == ids[:lead]:
            ids, end = ids[lead:], end - lead
        if tail and ids[end - tail:end] == ids[end:]:
            ids = ids[:end]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | Path | ChatTemplate | None = None,
                            **template_kwargs) -> str:
        """The conversation rendered by the model's chat template (or `chat_template`: a file
        path or template text), ending with the assistant's header when add_generation_prompt."""
        return self._template(chat_template).render(messages, add_generation_prompt, **template_kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | Path | ChatTemplate | None = None, *,
                    content_as_text: bool = True, **template_kwargs) -> list[int]:
        """apply_chat_template() as token ids, without adding special tokens (the template writes
        its own BOS), as transformers' apply_chat_template(tokenize=True) does — except that each
        message's content is encoded as text (checkpoint/content_tokens.py): only the template's
        own markup yields control tokens, so a user who writes `<|eot_id|><|start_header_id|>
        system...` gets that text, not a system turn. content_as_text=False restores transformers'
        permissive encoding, for trusted callers."""
        def render(msgs):
            return self.apply_chat_template(msgs, add_generation_prompt, chat_template, **template_kwargs)
        text = render(messages)
        if not content_as_text:
            return self.encode(text, add_special_tokens=False)
        from tinyvllm.checkpoint.content_tokens import encode_chat
        return encode_chat(self, messages, text, render)

    def _template(self, chat_template) -> ChatTemplate:
        if isinstance(chat_template, ChatTemplate):
            return chat_template
        if chat_template is not None:
            special = self.chat_template.special_tokens if self.chat_template else {}
            return _compiled(*read_explicit(chat_template), tuple(sorted(special.items())))
        if self.chat_template is None:
            raise InvalidRequestError(
                f"{self.source} has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json) and its vocabulary is not Llama 3's; pass one with "
                "--chat-template FILE (or chat_template=)")
        return self.chat_template


@lru_cache(maxsize=16)
def _compiled(text: str, source: str, special: tuple) -> ChatTemplate:
    """Explicit per-call templates, compiled once per distinct text."""
    return ChatTemplate(text, source, dict(special))


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    A character can span tokens (an emoji is 4 bytes, often 2-3 byte-level tokens), and decoding
    a token sequence that stops mid-character yields U+FFFD. So each step decodes a short window
    — the text since the last emitted boundary — and emits only when it does not end in U+FFFD.
    Window starts are always points where decoding came out clean, i.e. character boundaries,
    so the pieces concatenate to decode(all ids). A little preceding context is decoded along
    with the window because some tokenizers render a token differently at the start of a text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0     # start of the context decoded along with the new tokens
        self.read_offset = 0       # everything before this has been emitted
        self.text = ""             # all text emitted so far
        # tokenizers >= 0.21 runs this very algorithm in Rust (DecodeStream: the same windows,
        # the same U+FFFD test), ~5x faster than two decode() calls from Python per token
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if DecodeStream else None

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token; -> the newly completed text (often "", never a broken character)."""
        token_id = int(token_id)
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self.tokenizer.backend, token_id)
            except Exception:      # noqa: BLE001 — Rust errors arrive as bare Exceptions
                self._stream, piece = None, self._decode_window()   # carry on in Python
        else:
            piece = self._decode_window()
        if not piece:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += piece
        return piece

    def _decode_window(self) -> str | None:
        """The new text if the window since read_offset decodes to whole characters."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return None
        return full[len(prefix):]

    def decode_all(self, ids) -> str:
        """What add() for each id and then flush() emit in all, in one decode call (the pieces
        concatenate to decode(all ids)). The detokenizer's own state is left alone."""
        return self._decode(ids)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (a truly incomplete character
        comes out as U+FFFD, exactly as decode(all ids) renders it)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        piece = self._decode(self.ids[self.prefix_offset:])[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += piece
        return piece


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
