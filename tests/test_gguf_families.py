"""GGUF import of llama.cpp's qwen2, qwen3 and gemma3 architectures: tiny files written with
gguf.GGUFWriter as llama.cpp's converter lays each family out (tests/gguf_helpers.py: no q/k row
permutation, Qwen2's biases, the q/k norms, Gemma 3's four norms stored with their 1 added)
convert back to the family's config and weights, bit for bit; the tokenizers: Qwen2's split (one
digit a piece, NFC first) and Gemma 3's sentencepiece vocabulary rebuilt as a byte-fallback BPE."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_helpers import tiny_hf_config, tiny_hf_weights, tiny_vocab, write_gguf  # noqa: E402

from tinyvllm.checkpoint.gguf import convert_gguf  # noqa: E402
from tinyvllm.checkpoint.weights import load_weights  # noqa: E402
from tinyvllm.config import ModelConfig  # noqa: E402
from tinyvllm.errors import ModelLoadError  # noqa: E402


def _round_trip(tmp_path, cfg: dict, arch: str, **kwargs):
    """Write the family's file, convert it; -> (the converted directory, its weights)."""
    weights = tiny_hf_weights(cfg)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", cfg, weights, arch=arch, **kwargs), tmp_path / "hf")
    config = ModelConfig.from_pretrained(out)
    loaded = load_weights(out, config)
    assert loaded.keys() == weights.keys()
    for name, w in weights.items():       # exactly bf16 values: an F32 file converts back bit for bit
        assert loaded[name].dtype == ml_dtypes.bfloat16 and np.array_equal(loaded[name].astype(np.float32), w), name
    return out, config


def test_qwen2_converts_with_its_biases_and_rows_as_they_are(tmp_path):
    tokens, _, _ = tiny_vocab()
    cfg = tiny_hf_config(len(tokens), architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    out, config = _round_trip(tmp_path, cfg, "qwen2", tokenizer_pre="qwen2")
    assert config == ModelConfig.from_dict(cfg) and config.qkv_bias and config.family == "qwen2"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_qwen3_converts_with_its_qk_norms_and_own_head_dim(tmp_path):
    tokens, _, _ = tiny_vocab()
    cfg = tiny_hf_config(len(tokens), architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32)
    _, config = _round_trip(tmp_path, cfg, "qwen3", tokenizer_pre="qwen2",
                            meta={"qwen3.attention.key_length": ("uint32", 32),
                                  "qwen3.attention.value_length": ("uint32", 32),
                                  "qwen3.rope.dimension_count": ("uint32", 32)})
    assert config == ModelConfig.from_dict(cfg) and config.qk_norm and config.q_size == 4 * 32


def test_qwen2_tokenizer_splits_digits_one_by_one_after_nfc(tmp_path):
    """Qwen2's pattern cuts "2024" into four digits, so the merge "2 0" never applies (GPT-2's
    would take "20"); NFC makes e + combining acute the one character é first."""
    from tokenizers import Tokenizer
    tokens, merges, types = tiny_vocab()
    vocab = (tokens[:-3] + ["20"] + tokens[-3:], merges + ["2 0"], types[:-3] + [1] + types[-3:])
    cfg = tiny_hf_config(len(vocab[0]), architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    path = write_gguf(tmp_path / "m.gguf", cfg, tiny_hf_weights(cfg), arch="qwen2", tokenizer_pre="qwen2", vocab=vocab)
    tok = Tokenizer.from_file(str(convert_gguf(path, tmp_path / "hf") / "tokenizer.json"))
    assert tok.encode("2024").tokens == ["2", "0", "2", "4"]
    assert tok.encode("e\u0301").ids == tok.encode("\u00e9").ids
    assert tok.decode(tok.encode("hello world 2024").ids) == "hello world 2024"


# Gemma 3's sentencepiece vocabulary in small: the control tokens, <unk>, the 256 byte tokens, the
# pieces in merge order, a run of two spaces stored as spaces, and the turn markers
GEMMA_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁w", "or", "ld", "▁wor",
                "▁world", "  ", "▁hello"]


def gemma_vocab():
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + GEMMA_PIECES
    tokens += ["<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(GEMMA_PIECES) + [3, 3]
    scores = [0.0] * 260 + [-float(i) for i in range(len(GEMMA_PIECES))] + [0.0, 0.0]
    return tokens, types, scores


def _gemma3_file(tmp_path, layers=6, **meta):
    tokens, types, scores = gemma_vocab()
    cfg = tiny_hf_config(len(tokens), architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                         num_hidden_layers=layers, bos_token_id=2, eos_token_id=1)
    a = "gemma3."
    kv = {"tokenizer.ggml.scores": ("array", scores), "tokenizer.ggml.unknown_token_id": ("uint32", 3),
          "tokenizer.ggml.add_space_prefix": ("bool", False), a + "attention.key_length": ("uint32", 16),
          a + "attention.value_length": ("uint32", 16), a + "attention.sliding_window": ("uint32", 8),
          a + "rope.scaling.type": ("string", "linear"), a + "rope.scaling.factor": ("float32", 8.0), **meta}
    return cfg, dict(arch="gemma3", vocab=(tokens, None, types), add_bos=True, meta=kv)


def test_gemma3_converts_its_norms_layers_and_ropes(tmp_path):
    cfg, kwargs = _gemma3_file(tmp_path)
    out, config = _round_trip(tmp_path, cfg, **kwargs)
    assert config.family == "gemma3_text" and config.sandwich_norms and config.qk_norm and config.norm_weight_offset == 1
    assert config.sliding_window == 8 and config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.query_pre_attn_scalar == 16 and config.hidden_act == "gelu_tanh" and config.tie_word_embeddings
    assert (config.rope_theta, config.rope_scaling.factor) == (100000.0, 8.0)
    assert config.sliding_rope_theta == 10000.0 and config.sliding_rope_scaling is None


def test_gemma3_norm_shift_is_undone_exactly(tmp_path):
    """llama.cpp's converter stores a bf16 checkpoint's norm as bf16(1 + w): the import's
    bf16(1 + w) - 1 is exact in bf16, so the engine's 1 + w' is llama.cpp's multiplier."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, 4096).astype(ml_dtypes.bfloat16).astype(np.float32)
    stored = (w.astype(ml_dtypes.bfloat16) + ml_dtypes.bfloat16(1)).astype(np.float32)   # in bf16, as torch adds
    back = (stored - np.float32(1)).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(back + np.float32(1), stored)
    assert np.all(np.abs(back - w) <= 2.0 ** -8)


def test_gemma3_layer_pattern_and_full_layers_only(tmp_path):
    cfg, kwargs = _gemma3_file(tmp_path, layers=3)
    kwargs["meta"]["gemma3.attention.sliding_window_pattern"] = ("array", [True, False, True])
    _, config = _round_trip(tmp_path, cfg, **kwargs)
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    cfg, kwargs = _gemma3_file(tmp_path / "full", layers=3)
    del kwargs["meta"]["gemma3.attention.sliding_window"]
    (tmp_path / "full").mkdir()
    _, config = _round_trip(tmp_path / "full", cfg, **kwargs)
    assert config.sliding_window is None and config.layer_types == ()


def test_gemma3_tokenizer_is_its_sentencepiece_bpe(tmp_path):
    from tokenizers import Tokenizer
    cfg, kwargs = _gemma3_file(tmp_path)
    path = write_gguf(tmp_path / "m.gguf", cfg, tiny_hf_weights(cfg), **kwargs)
    tok = Tokenizer.from_file(str(convert_gguf(path, tmp_path / "hf") / "tokenizer.json"))
    assert tok.encode("hello world").tokens == ["<bos>", "hello", "▁world"]
    assert tok.encode("<start_of_turn>hello").tokens == ["<bos>", "<start_of_turn>", "hello"]
    assert tok.encode("hé").tokens == ["<bos>", "h", "<0xC3>", "<0xA9>"]        # é falls back to its bytes
    for text in ("hello world", "hello  world", "hé wor", " hello"):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text, text


def test_unknown_architecture_and_tokenizer_are_refused(tmp_path):
    tokens, _, _ = tiny_vocab()
    cfg = tiny_hf_config(len(tokens))
    for arch, expected in (("phi3", "general.architecture is 'phi3'"),):
        path = write_gguf(tmp_path / f"{arch}.gguf", cfg, tiny_hf_weights(cfg), arch=arch)
        with pytest.raises(ModelLoadError, match=expected):
            convert_gguf(path, tmp_path / "out")
    cfg, kwargs = _gemma3_file(tmp_path, layers=6)
    kwargs["meta"]["gemma3.rope.scaling.type"] = ("string", "yarn")
    with pytest.raises(ModelLoadError, match="RoPE scaling 'yarn'"):
        convert_gguf(write_gguf(tmp_path / "y.gguf", cfg, tiny_hf_weights(cfg), **kwargs), tmp_path / "out")
