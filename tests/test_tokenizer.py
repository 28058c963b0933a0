"""Tokenizer: the genuine Llama 3 vocabulary, special tokens as the post-processor adds them, eos
ids, chat ids, and streaming detokenization that never splits a character (chat templates
themselves: test_chat_template.py)."""
import json
import shutil

import pytest

from tinyvllm.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError

MULTIBYTE = "héllo 🦙🦙 日本語のテキスト café ∑ 👩‍👩‍👧 ok"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer.from_pretrained(tiny_model_dir)


def test_known_llama3_ids(tok):
    assert tok.encode("Hello world") == [128000, 9906, 1917]
    assert tok.encode("Hello world", add_special_tokens=False) == [9906, 1917]
    assert tok.vocab_size == 128256


def test_every_token_id_has_an_embedding_row(tok):
    # the packaged tokenizer is the Vision one, with <|image|> = 128256; the writer drops it
    assert tok.backend.token_to_id("<|image|>") is None
    assert max(tok.encode("<|image|> <|eot_id|>")) < 128256


def test_round_trip(tok):
    for text in ["Hello world", "  leading spaces\nand\ttabs", MULTIBYTE, ""]:
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_skipped_or_kept(tok):
    ids = [128000, 9906, 128009]
    assert tok.decode(ids) == "Hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>Hello<|eot_id|>"


def test_eos_ids_are_the_union_of_all_config_files(tok, tiny_model_dir, tmp_path):
    assert tok.bos_token_id == 128000
    assert tok.eos_token_ids == (128001, 128008, 128009)
    # a base-model layout: config says 128001 only, tokenizer_config says <|eot_id|>
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 128001, "bos_token_id": 128000}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (128001, 128009)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128008]}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (128001, 128008, 128009)


def test_eos_from_a_model_config(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path)
    config = ModelConfig.from_pretrained(tiny_model_dir)
    t = Tokenizer.from_pretrained(tmp_path, config)
    assert t.eos_token_ids == (128001, 128008, 128009) and t.bos_token_id == 128000


def test_missing_or_broken_tokenizer(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="cannot load tokenizer"):
        Tokenizer.from_pretrained(tmp_path)


def test_chat_ids_start_with_one_bos_and_use_special_ids(tok):
    ids = tok.encode_chat([{"role": "user", "content": "Hi!"}])
    assert ids[:2] == [128000, 128006] and ids.count(128000) == 1
    assert ids[-4:] == [128006, 78191, 128007, 271]    # assistant header, "\n\n"


def test_special_tokens_follow_the_post_processor(tok, tiny_model_dir, tmp_path):
    # config.json's bos_token_id plays no part: a post-processor without a BOS adds none
    d = tmp_path / "no-bos"
    d.mkdir()
    tokenizer = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(tokenizer))
    (d / "config.json").write_text(json.dumps({"bos_token_id": 128000}))
    assert Tokenizer.from_pretrained(d).encode("Hello world") == [9906, 1917]
    # the post-processor's token is added once even when the text already starts with it
    assert tok.encode("<|begin_of_text|>Hello") == [128000, 9906]
    assert tok.encode("Hello<|begin_of_text|>") == [128000, 9906, 128000]
    assert tok.encode("") == [128000]


def stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = [d.add(i) for i in ids]
    return pieces, d.flush(), d


def test_incremental_detokenizer_never_emits_broken_characters(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)      # the text really splits characters
    pieces, tail, d = stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE and tail == "" and d.text == MULTIBYTE
    assert "" in pieces                      # some tokens completed no character on their own


def test_incremental_detokenizer_with_special_tokens(tok):
    ids = tok.encode_chat([{"role": "user", "content": "日本 🦙"}])
    ids += tok.encode("ok 🦙", add_special_tokens=False) + [128009]
    for skip in (True, False):
        pieces, tail, _ = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_flushes_an_incomplete_character(tok):
    ids = tok.encode("a 🦙", add_special_tokens=False)[:-1]          # stop in the middle of the emoji
    pieces, tail, d = stream(tok, ids)
    assert "".join(pieces) == "a" and tail.endswith("\ufffd")
    assert d.text == tok.decode(ids)
