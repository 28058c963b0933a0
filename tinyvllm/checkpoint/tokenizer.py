"""Text <-> token ids for Llama 3 models: a thin layer over the `tokenizers` package (tokenizer.json),
the Llama 3 chat format written out explicitly, and streaming detokenization."""
from __future__ import annotations

import json
from pathlib import Path

from tinyvllm.config import ModelConfig
from tinyvllm.errors import InvalidRequestError, ModelLoadError

try:
    from tokenizers.decoders import DecodeStream      # tokenizers >= 0.21
except ImportError:
    DecodeStream = None

BEGIN_OF_TEXT = "<|begin_of_text|>"
START_HEADER, END_HEADER, END_OF_TURN = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
REPLACEMENT_CHAR = "\ufffd"     # what decoding yields for an incomplete UTF-8 sequence


class Tokenizer:
    def __init__(self, backend, bos_token_id: int | None, eos_token_ids: tuple[int, ...]):
        self.backend = backend                  # a tokenizers.Tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: ModelConfig | None = None) -> "Tokenizer":
        """Load tokenizer.json from a model directory. End-of-sequence ids are the union of
        those named by config.json (or `config`), generation_config.json and
        tokenizer_config.json: Instruct models end turns with <|eot_id|> but list others too."""
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
        bos = (config.bos_token_id if config else None) or model_cfg.get("bos_token_id") \
            or generation_cfg.get("bos_token_id") or token_id(tokenizer_cfg.get("bos_token")) \
            or backend.token_to_id(BEGIN_OF_TEXT)
        return cls(backend, bos, tuple(sorted(eos)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Special tokens written in the text (<|eot_id|> ...) become their ids. The BOS is added
        only when the text does not already begin with one (a chat template does)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The Llama 3 chat format: <|begin_of_text|>, then each message as
        <|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>, then (to have the model
        answer) an open assistant header."""
        parts = [BEGIN_OF_TEXT]
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"message {i} must be a dict with string 'role' and "
                                          f"'content', got {m!r}")
            parts.append(f"{START_HEADER}{m['role']}{END_HEADER}\n\n{m['content']}{END_OF_TURN}")
        if add_generation_prompt:
            parts.append(f"{START_HEADER}assistant{END_HEADER}\n\n")
        return "".join(parts)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        return self.apply_chat_template(messages + [{"role": "user", "content": user}])


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
