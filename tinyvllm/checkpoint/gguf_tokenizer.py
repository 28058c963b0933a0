"""tokenizer.json and tokenizer_config.json rebuilt from a GGUF file's vocabulary metadata.

A GGUF keeps no tokenizer.json: it stores the tokens (`tokenizer.ggml.tokens`), the BPE merges
(`merges`), each token's kind (`token_type`: 1 normal, 3 control, 4 user-defined, ...), the
special ids and flags. For a byte-level BPE vocabulary (`tokenizer.ggml.model` = "gpt2": GPT-2,
SmolLM, Llama 3) the tokenizer is rebuilt with the `tokenizers` library so that it encodes as
transformers' own GGUF loader does:

  * model: BPE over the vocabulary and merges (no unknown token, no byte fallback);
  * pre-tokenizer: byte-level with GPT-2's split pattern, or Llama 3's pattern for files whose
    `tokenizer.ggml.pre` says llama-bpe;
  * control tokens become special added tokens (matched whole, dropped by skip_special_tokens),
    user-defined ones plain added tokens;
  * post-processor: adds BOS / EOS only when `tokenizer.ggml.add_bos_token` / `add_eos_token` is
    true (SmolLM2's is false: its chat template writes every marker itself).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError

CONTROL, USER_DEFINED = 3, 4
# Llama 3's split pattern, as in Meta's tokenizer.json for Llama 3.x
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split pattern (None = GPT-2's, built into the byte-level pre-tokenizer).
# "smollm" splits digits one by one in llama.cpp; its vocabulary has no merge involving a digit,
# so GPT-2's pattern gives the same ids (and it is what transformers uses).
PRE_TOKENIZERS = {None: None, "default": None, "gpt2": None, "smollm": None,
                  "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: the printable Latin-1 bytes stand for
    themselves, the other 68 bytes (controls, space, ...) for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None
    eos_ids: list[int]          # EOS, then end-of-turn ids llama.cpp lists separately (EOT, EOM)


def build_tokenizer(meta: dict, source: str):
    """A tokenizers.Tokenizer for the file's vocabulary (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{source}: tokenizer.ggml.model is {kind!r}; tinyvllm rebuilds "
                             "byte-level BPE vocabularies ('gpt2') only")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(k for k in PRE_TOKENIZERS if k)
        raise ModelLoadError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported (known: {known})")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    merges = list(meta.get("tokenizer.ggml.merges") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens or len(types) != len(tokens):
        raise ModelLoadError(f"{source}: tokenizer.ggml.tokens/token_type missing or of different lengths")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # a token written with characters outside the byte alphabet is respelled byte by byte
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{source}: tokenizer.ggml.tokens has duplicate entries")
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"{source}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((parts[0], parts[1]))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=False,
                                   continuing_subword_prefix="", end_of_word_suffix=""))
    except Exception as e:  # noqa: BLE001 — the Rust side raises a bare Exception
        raise ModelLoadError(f"{source}: inconsistent vocabulary and merges ({e})") from None
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    split = PRE_TOKENIZERS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabelled byte sequence, not a
    # marker; transformers leaves it out of the special tokens and so do we.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])
    tok.post_processor = _post_processor(meta, tokens, processors)
    return tok


def _post_processor(meta: dict, tokens: list[str], processors):
    def flagged(flag, key):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return (tokens[int(token_id)], int(token_id)) if meta.get(flag) and token_id is not None else None
    bos = flagged("tokenizer.ggml.add_bos_token", "bos")
    eos = flagged("tokenizer.ggml.add_eos_token", "eos")
    wrap = lambda seq: " ".join([*([bos[0]] if bos else []), seq, *([eos[0]] if eos else [])])
    return processors.TemplateProcessing(single=wrap("$A"), pair=f"{wrap('$A')} {wrap('$B:1')}",
                                         special_tokens=[t for t in (bos, eos) if t])


def write_tokenizer_files(meta: dict, config: ModelConfig, out: Path, source: str) -> SpecialTokens:
    """tokenizer.json and tokenizer_config.json (special tokens, add_bos_token as the file says,
    the file's chat template) into out."""
    tok = build_tokenizer(meta, source)
    if tok.get_vocab_size(with_added_tokens=True) > config.vocab_size:
        raise ModelLoadError(f"{source}: {tok.get_vocab_size()} tokens but the embedding has "
                             f"{config.vocab_size} rows")
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None:
            return None
        if not 0 <= int(token_id) < len(tokens):
            raise ModelLoadError(f"{source}: tokenizer.ggml.{key}_token_id {token_id} is not a token id")
        return tokens[int(token_id)]

    tok.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  **{f"{k}_token": token(key) for k, key in (("bos", "bos"), ("eos", "eos"),
                                                             ("unk", "unknown"), ("pad", "padding"))},
                  "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                  "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                  "model_max_length": config.max_position_embeddings,
                  "clean_up_tokenization_spaces": False}
    if meta.get("tokenizer.chat_template") is not None:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    eos_ids = []
    for key in ("eos", "eot", "eom"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token(key) is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return SpecialTokens(None if bos is None else int(bos), eos_ids)
