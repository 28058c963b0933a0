"""Chat message content encoded as text: only the chat template's own markup yields control
tokens. Without this, a user message holding "<|eot_id|><|start_header_id|>system<|end_header_id|>"
becomes real control ids and opens a system turn (transformers and vLLM encode it so by default;
a server shared by several users must not).

Most content holds no special-token text, and its conversation is encoded in one call, exactly
as before. When some does, the template is rendered a second time with each message's content
replaced by a sentinel; if substituting the contents (or their trimmed form: templates often
`| trim`) back into that rendering reproduces the real one, the sentinels mark exactly where each
content lies: those spans are encoded with special tokens read as plain text, the markup between
them as usual. A template that changes content some other way cannot be split so: such a
conversation is refused (InvalidRequestError) rather than encoded unsafely."""
from __future__ import annotations

import re
from functools import lru_cache

from tinyvllm.errors import InvalidRequestError

SENTINEL = "\ue000{}\ue001"             # private-use characters: no template writes them


@lru_cache(maxsize=8)
def _content_backends(tokenizer):
    """(a clone of the backend that encodes special-token text as text, a regex of the special
    tokens' texts) for this tokenizer, made once."""
    from tokenizers import Tokenizer as Backend
    backend = tokenizer.backend
    as_text = Backend.from_str(backend.to_str())
    as_text.encode_special_tokens = True
    specials = sorted({t.content for t in backend.get_added_tokens_decoder().values() if t.special},
                      key=len, reverse=True)
    return as_text, re.compile("|".join(map(re.escape, specials))) if specials else None


def prepare(tokenizer) -> None:
    """Make this tokenizer's clone now. Cloning serializes the whole tokenizer (about a second
    for Llama 3's) while holding the GIL: a server does it at start, not in its first chat
    request, where it would stall every other thread."""
    _content_backends(tokenizer)


def encode(backend, text: str) -> list[int]:
    """encode_batch of one text: unlike encode(), it releases the GIL while it works."""
    return backend.encode_batch([text], add_special_tokens=False)[0].ids if text else []


def encode_chat(tokenizer, messages: list[dict], rendered: str, render) -> list[int]:
    """The token ids of `rendered` (the template's output for `messages`), with every message's
    content encoded as text. render(messages) renders another list of messages the same way."""
    as_text, specials = _content_backends(tokenizer)
    contents = [m.get("content") if isinstance(m, dict) else None for m in messages]
    if specials is None or not any(isinstance(c, str) and specials.search(c) for c in contents):
        return encode(tokenizer.backend, rendered)
    marked = [{**m, "content": SENTINEL.format(i)} if isinstance(c, str) else m
              for i, (m, c) in enumerate(zip(messages, contents))]
    skeleton = render(marked)
    pieces = re.split("\ue000(\\d+)\ue001", skeleton)      # markup, index, markup, index, ...
    ids, rebuilt, here = [], [], 0
    for k, piece in enumerate(pieces):
        if k % 2:               # a content: in the form the real rendering holds (as given, or trimmed)
            content = contents[int(piece)]
            piece = content if rendered.startswith(content, here) else content.strip()
        ids += encode(as_text if k % 2 else tokenizer.backend, piece)
        rebuilt.append(piece)
        here += len(piece)
    if "".join(rebuilt) != rendered:
        raise InvalidRequestError(
            "a message holds special-token text (such as <|eot_id|>) and this chat template "
            "changes message content in a way that keeps it from being encoded as plain text")
    return ids
