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
Qwen2's and Qwen3's files (`pre` "qwen2") split with Qwen2's pattern (one digit a piece) after an
NFC normalizer, as transformers' Qwen2 tokenizer does.

Gemma 3's files hold a sentencepiece vocabulary (`tokenizer.ggml.model` = "llama": tokens,
scores, token types, no merges). It is rebuilt as transformers' GGUF loader rebuilds Gemma's, a
BPE whose merges come from the vocabulary itself (gemma_merges): spaces are written "▁" (the
normalizer), runs of spaces stored as spaces are respelled "▁▁...", a piece the vocabulary lacks
falls back to its <0xNN> byte tokens, and the decoder turns "▁" back into spaces and fuses bytes.
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
# Qwen2's (transformers' Qwen2Converter): as Llama 3's, but digits one by one
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {None: None, "default": None, "gpt2": None, "smollm": None,
                  "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
                  "qwen2": QWEN2_SPLIT}
NFC_PRE_TOKENIZERS = ("qwen2",)      # normalized to NFC before the split
SPACE_PIECE = "\u2581"               # sentencepiece's "▁"


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
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama" and meta.get("general.architecture") == "gemma3":
        return build_gemma_tokenizer(meta, source)
    if kind != "gpt2":
        raise ModelLoadError(f"{source}: tokenizer.ggml.model is {kind!r}; tinyvllm rebuilds byte-level BPE "
                             "vocabularies ('gpt2'), and Gemma 3's sentencepiece one ('llama') only")
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
    if pre in NFC_PRE_TOKENIZERS:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabelled byte sequence, not a
    # marker; transformers leaves it out of the special tokens and so do we.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])
    tok.post_processor = _post_processor(meta, tokens, processors)
    return tok


def gemma_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges from a sentencepiece vocabulary stored in merge order (Gemma's, whose scores
    are ranks with placeholders among them): every split of a token into two vocabulary pieces is
    a merge, ranked by the token's position (earlier first), its splits by their pieces' scores
    (higher first) — transformers' GGUF loader's rule for Gemma (merge_ranks_from_vocab_order)."""
    score = dict(zip(tokens, scores))
    merges = []
    for position, token in enumerate(tokens):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in score and token[i:] in score]
        splits.sort(key=lambda pair: (score[pair[0]], score[pair[1]]), reverse=True)
        merges += [(position, pair) for pair in splits]
    return [pair for _, pair in sorted(merges, key=lambda m: m[0])]


def build_gemma_tokenizer(meta: dict, source: str):
    """Gemma 3's sentencepiece vocabulary as a byte-fallback BPE (module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens or len(scores) != len(tokens) or len(types) != len(tokens):
        raise ModelLoadError(f"{source}: tokenizer.ggml.tokens/scores/token_type missing or of different lengths")
    # a run of spaces is stored as spaces; the vocabulary (and the merges) write it as "▁"s
    tokens = [SPACE_PIECE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{source}: tokenizer.ggml.tokens has duplicate entries")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=gemma_merges(tokens, scores), dropout=None,
                               unk_token=tokens[int(unk)] if unk is not None else None, fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE_PIECE)
    steps = [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
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
