"""GGUF import: tiny synthetic files written with gguf.GGUFWriter (tests/gguf_helpers.py) from a
known HF-layout model convert back to that model: config, weights, tokenizer; and every file the
import cannot honour is one clear ModelLoadError."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_helpers import CHATML, tiny_hf_config, tiny_hf_weights, tiny_vocab, write_gguf  # noqa: E402

from tinyvllm.checkpoint.gguf import convert_gguf, permute_rope_rows, unpermute_rope_rows  # noqa: E402
from tinyvllm.checkpoint.weights import load_weights  # noqa: E402
from tinyvllm.config import ModelConfig  # noqa: E402
from tinyvllm.errors import ModelLoadError  # noqa: E402

ROUND_TRIP_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@pytest.fixture(scope="module")
def tiny():
    tokens, _, _ = tiny_vocab()
    cfg = tiny_hf_config(len(tokens))
    return cfg, tiny_hf_weights(cfg)


# ---- the q/k row order ------------------------------------------------------------------------

@pytest.mark.parametrize("heads,head_dim", [(1, 4), (4, 16), (3, 64)])
def test_unpermute_inverts_permute(rng, heads, head_dim):
    w = rng.normal(size=(heads * head_dim, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(permute_rope_rows(w, heads), heads), w)
    assert np.array_equal(permute_rope_rows(unpermute_rope_rows(w, heads), heads), w)
    assert not np.array_equal(permute_rope_rows(w, heads), w)


def test_permutation_turns_rotate_half_rope_into_interleaved_rope(rng):
    """What the permutation is for: HF's RoPE (dimension i paired with i + D/2) applied to
    q = W x gives, row for row permuted, llama.cpp's RoPE (pairs 2i, 2i+1) applied to the
    permuted W x. So unpermuting a GGUF's rows is exactly what makes HF maths right."""
    heads, d, pos = 3, 8, 7
    w, x = rng.normal(size=(heads * d, 6)), rng.normal(size=6)
    angle = pos / 10000.0 ** (np.arange(0, d, 2) / d)
    cos, sin = np.cos(angle), np.sin(angle)

    def rope_half(v):          # HF rotate_half
        a, b = v[: d // 2], v[d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin])

    def rope_pairs(v):         # llama.cpp / Meta: adjacent pairs
        a, b = v[0::2], v[1::2]
        out = np.empty_like(v)
        out[0::2], out[1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    hf = np.concatenate([rope_half(h) for h in (w @ x).reshape(heads, d)])
    gg = np.concatenate([rope_pairs(h) for h in (permute_rope_rows(w, heads) @ x).reshape(heads, d)])
    np.testing.assert_allclose(gg, permute_rope_rows(hf[:, None], heads)[:, 0], rtol=1e-12, atol=1e-12)


# ---- round trips ------------------------------------------------------------------------------

def test_f32_file_round_trips_config_weights_and_tokenizer(tmp_path, tiny):
    cfg, weights = tiny
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", cfg, weights), tmp_path / "hf")
    config = ModelConfig.from_pretrained(out)
    assert config == ModelConfig.from_dict(cfg)
    loaded = load_weights(out, config)
    assert loaded.keys() == weights.keys()
    for name, w in weights.items():
        assert loaded[name].dtype == ml_dtypes.bfloat16
        assert np.array_equal(loaded[name].astype(np.float32), w), name
    written = json.loads((out / "config.json").read_text())
    assert written["tie_word_embeddings"] is True and written["rms_norm_eps"] == 1e-5
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tok_cfg["chat_template"] == CHATML and tok_cfg["add_bos_token"] is False
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg["bos_token_id"], cfg["eos_token_id"])


@pytest.mark.parametrize("qtype", ROUND_TRIP_TYPES)
def test_quantized_weights_equal_gguf_dequantization_in_hf_order(tmp_path, tiny, qtype):
    """Each 2-D tensor converts to bf16(dequantize(quantize(w))) computed directly in HF row
    order: quantization blocks run along rows, so the expected values do not go through the
    converter's own permutation code at all."""
    cfg, weights = tiny
    t = gguf.GGMLQuantizationType[qtype]
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", cfg, weights, qtype=qtype), tmp_path / "hf")
    loaded = load_weights(out, ModelConfig.from_pretrained(out))
    for name, w in weights.items():
        if w.ndim == 1 or qtype == "F32":
            expected = w
        elif qtype == "F16":
            expected = w.astype(np.float16).astype(np.float32)
        else:
            expected = gguf.quants.dequantize(gguf.quants.quantize(w, t), t)
        expected = expected.astype(ml_dtypes.bfloat16)
        assert np.array_equal(loaded[name].view(np.uint16), expected.view(np.uint16)), name


def test_untied_output_weight_becomes_lm_head(tmp_path):
    tokens, _, _ = tiny_vocab()
    cfg = tiny_hf_config(len(tokens), tie_word_embeddings=False)
    weights = tiny_hf_weights(cfg)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", cfg, weights), tmp_path / "hf")
    config = ModelConfig.from_pretrained(out)
    assert config.tie_word_embeddings is False
    assert np.array_equal(load_weights(out, config)["lm_head.weight"].astype(np.float32),
                          weights["lm_head.weight"])


def test_tokenizer_vocabulary_specials_and_bos_flag(tmp_path, tiny):
    from tokenizers import Tokenizer
    cfg, weights = tiny
    tokens, merges, _ = tiny_vocab()
    for add_bos in (False, True):
        path = write_gguf(tmp_path / f"m{add_bos}.gguf", cfg, weights, add_bos=add_bos)
        out = convert_gguf(path, tmp_path / f"hf{add_bos}")
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        assert [tok.id_to_token(i) for i in range(len(tokens))] == tokens
        # merges apply in rank order: "hello" is he + llo; " the" and " world" whole tokens
        enc = tok.encode("hello the world<|im_end|>")
        bos = [cfg["bos_token_id"]] if add_bos else []
        assert enc.tokens[len(bos):] == ["he", "llo", "Ġthe", "Ġworld", "<|im_end|>"]
        assert enc.ids[:len(bos)] == bos
        text = "naïve 😀 <|im_start|>x\n\tend"
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == \
            ("<|im_start|>" if add_bos else "") + text
        assert tok.decode(tok.encode(text).ids) == text.replace("<|im_start|>", "")
        assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is add_bos


def test_llama3_vocabulary_encodes_like_metas_tokenizer(tmp_path):
    """A GGUF holding (a consistent slice of) Llama 3's real vocabulary with tokenizer.ggml.pre
    'llama-bpe' encodes exactly as Meta's own tokenizer.json does, BOS included."""
    from tokenizers import Tokenizer

    from tinyvllm.checkpoint.model_writer import tokenizer_source_dir
    meta_tok = json.loads((tokenizer_source_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    keep = 3000
    vocab = {t: i for t, i in meta_tok["model"]["vocab"].items() if i < keep}
    merges = [m for m in meta_tok["model"]["merges"]
              if all(p in vocab for p in m.split(" ")) and m.replace(" ", "") in vocab]
    specials = sorted((t for t in meta_tok["added_tokens"] if 128000 <= t["id"] < 128256), key=lambda t: t["id"])
    renumber = {t["id"]: keep + i for i, t in enumerate(specials)}
    tokens = sorted(vocab, key=vocab.get) + [t["content"] for t in specials]
    assert len(tokens) == keep + len(specials)
    # Meta's tokenizer cut to the same vocabulary, ids renumbered the same way: the reference
    meta_tok["model"].update(vocab=vocab, merges=merges)
    meta_tok["added_tokens"] = [dict(t, id=renumber[t["id"]]) for t in specials]
    processors = meta_tok["post_processor"]["processors"]
    for proc in processors:
        for special in proc.get("special_tokens", {}).values():
            special["ids"] = [renumber[i] for i in special["ids"]]
    reference = Tokenizer.from_str(json.dumps(meta_tok))
    bos, eos = renumber[128000], renumber[128009]
    cfg = tiny_hf_config(len(tokens), bos_token_id=bos, eos_token_id=eos)
    types = [1] * keep + [3] * len(specials)
    path = write_gguf(tmp_path / "l3.gguf", cfg, tiny_hf_weights(cfg), vocab=(tokens, merges, types),
                      tokenizer_pre="llama-bpe", add_bos=True)
    ours = Tokenizer.from_file(str(convert_gguf(path, tmp_path / "hf") / "tokenizer.json"))
    texts = ["The capital of France is", "  two  spaces\n\n\ttab", "I'm 12345 years old, aren't I?",
             "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "Grüße, 日本語, emoji 😀!",
             "def f(x):\n    return x**2  # square\r\n", "", "   ", "ÀÉÎõü ß ∑∫√"]
    texts += ["".join(np.random.default_rng(i).choice(list("ab c1.\n'Ü😀<|>"), 30)) for i in range(30)]
    for text in texts:
        assert ours.encode(text).ids == reference.encode(text).ids, repr(text)
        assert ours.encode(text).ids[:1] == [bos]


def test_k_quant_tensor_converts_to_ggufs_dequantization(tmp_path, tiny):
    """K-quants: gguf can decode but not encode them, so a tensor of random Q6_K blocks is
    checked to come out as gguf's own dequantization of those bytes."""
    cfg, weights = tiny
    cfg = dict(cfg, hidden_size=256, head_dim=64, intermediate_size=256)   # rows of 256 values
    weights = tiny_hf_weights(cfg)
    qtype = gguf.GGMLQuantizationType.Q6_K
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = weights["model.layers.0.mlp.up_proj.weight"].shape
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    raw[:, -2:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)     # a sane scale
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, drop=("blk.0.ffn_up",),
                      extra_tensors={"blk.0.ffn_up.weight": (raw, qtype)})
    out = convert_gguf(path, tmp_path / "hf")
    got = load_weights(out, ModelConfig.from_pretrained(out))["model.layers.0.mlp.up_proj.weight"]
    expected = gguf.quants.dequantize(raw, qtype).astype(ml_dtypes.bfloat16)
    assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))


# ---- clear errors -----------------------------------------------------------------------------

def convert_error(tmp_path, path) -> str:
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(path, tmp_path / "out")
    return str(e.value)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path, tiny):
    cfg, _ = tiny
    qtype = gguf.GGMLQuantizationType.IQ2_XXS
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    cfg2 = dict(cfg, hidden_size=256, head_dim=64)          # rows of 256 values
    weights = tiny_hf_weights(cfg2)
    rows, cols = weights["model.layers.1.self_attn.v_proj.weight"].shape
    raw = np.zeros((rows, cols // block * size), np.uint8)
    path = write_gguf(tmp_path / "m.gguf", cfg2, weights, drop=("blk.1.attn_v",),
                      extra_tensors={"blk.1.attn_v.weight": (raw, qtype)})
    msg = convert_error(tmp_path, path)
    assert "blk.1.attn_v.weight" in msg and "IQ2_XXS" in msg and "Q4_1" in msg


def test_unknown_architecture_is_refused(tmp_path, tiny):
    cfg, weights = tiny
    msg = convert_error(tmp_path, write_gguf(tmp_path / "m.gguf", cfg, weights, arch="gemma2"))
    assert "general.architecture is 'gemma2'" in msg and "'qwen3'" in msg     # and what is converted


@pytest.mark.parametrize("cut", [10, 200, 3000, -100])
def test_truncated_file_is_refused(tmp_path, tiny, cut):
    cfg, weights = tiny
    data = write_gguf(tmp_path / "m.gguf", cfg, weights).read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    msg = convert_error(tmp_path, bad)
    assert "truncated" in msg or "corrupt" in msg


def test_crafted_header_counts_are_refused(tmp_path, tiny):
    cfg, weights = tiny
    data = bytearray(write_gguf(tmp_path / "m.gguf", cfg, weights).read_bytes())
    for offset in (8, 16):                  # tensor count, key/value count
        bad = bytearray(data)
        bad[offset:offset + 8] = struct.pack("<Q", 1 << 60)
        path = tmp_path / f"crafted{offset}.gguf"
        path.write_bytes(bytes(bad))
        assert "corrupt GGUF header: the header claims" in convert_error(tmp_path, path)
    path = tmp_path / "notgguf.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in convert_error(tmp_path, path)


def test_unknown_tensor_missing_tensor_and_unsupported_features_are_refused(tmp_path, tiny):
    cfg, weights = tiny
    tokens, merges, types = tiny_vocab()
    bias = (np.zeros(64, np.float32), None)
    cases = {
        "attn_q.bias": dict(extra_tensors={"blk.0.attn_q.bias": bias}),
        "no tensor for 'model.layers.1.mlp.down_proj.weight'": dict(drop=("blk.1.ffn_down",)),
        "rope_freqs.weight": dict(extra_tensors={"rope_freqs.weight": (np.ones(8, np.float32), None)}),
        "mixture-of-experts": dict(meta={"llama.expert_count": ("uint32", 8)}),
        "RoPE scaling 'linear'": dict(meta={"llama.rope.scaling.type": ("string", "linear")}),
        "partial rotary": dict(meta={"llama.rope.dimension_count": ("uint32", 8)}),
        "tokenizer.ggml.pre 'deepseek-coder' is not supported": dict(tokenizer_pre="deepseek-coder"),
        "tokenizer.ggml.model is 'llama'": dict(meta={"tokenizer.ggml.model": ("string", "llama")}),
        "inconsistent vocabulary and merges": dict(vocab=(tokens, merges + ["x yz"], types)),
    }
    for i, (expected, kwargs) in enumerate(cases.items()):
        msg = convert_error(tmp_path, write_gguf(tmp_path / f"m{i}.gguf", cfg, weights, **kwargs))
        assert expected in msg, (expected, msg)


def test_cli_convert_gguf(tmp_path, tiny):
    cfg, weights = tiny
    path = write_gguf(tmp_path / "m.gguf", cfg, weights)
    run = lambda *a: subprocess.run([sys.executable, "-m", "tinyvllm", "convert-gguf", *a],
                                    capture_output=True, text=True, timeout=120)
    ok = run(str(path), str(tmp_path / "hf"))
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:500])
    err = run(str(bad), str(tmp_path / "hf2"))
    assert err.returncode == 2 and err.stderr.count("\n") == 1 and "tinyvllm: error:" in err.stderr


# ---- crafted headers: every length and offset is checked before gguf's reader sees the file ----

def _u32(v):
    return struct.pack("<I", v)


def _u64(v):
    return struct.pack("<Q", v)


def _str(text: bytes, length: int | None = None) -> bytes:
    return _u64(len(text) if length is None else length) + text


ARCH = _str(b"general.architecture") + _u32(8) + _str(b"llama")


def _tensor(name=b"token_embd.weight", dims=(16, 4), ggml_type=0, offset=0, n_dims=None):
    return (_str(name) + _u32(len(dims) if n_dims is None else n_dims)
            + b"".join(_u64(d) for d in dims) + _u32(ggml_type) + _u64(offset))


def _gguf(kvs=(ARCH,), tensors=(), n_kv=None, n_tensors=None, data=b"\0" * 256) -> bytes:
    head = (b"GGUF" + _u32(3) + _u64(len(tensors) if n_tensors is None else n_tensors)
            + _u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors))
    return head + b"\0" * (-len(head) % 32) + data


@pytest.mark.parametrize("raw, message", [
    (_gguf(kvs=[_str(b"k", 2**62) + b"x"]), "metadata key is 4611686018427387904 bytes long"),
    (_gguf(kvs=[ARCH, _str(b"a") + _u32(8) + _str(b"v", 2**40)]), r"metadata 'a' is 1099511627776 bytes"),
    (_gguf(kvs=[_str(b"a") + _u32(9) + _u32(0) + _u64(2**40)]), "claims 1099511627776 items"),
    (_gguf(kvs=[_str(b"a") + _u32(9) + _u32(8) + _u64(1 << 20)]), "claims 1048576 items: more than the file"),
    (_gguf(kvs=[_str(b"a") + _u32(9) + _u32(8) + _u64(2) + _str(b"x") + _str(b"y", 10**6)]),
     "runs past the end of the file"),
    (_gguf(kvs=[_str(b"a") + _u32(9) + (_u32(9) + _u64(1)) * 3 + _u32(0) + _u64(0)]), "nested more than"),
    (_gguf(kvs=[_str(b"a") + _u32(99) + _u64(0)]), "unknown value type 99"),
    (_gguf(n_kv=2**40), "claims 1099511627776 metadata keys"),
    (_gguf(n_tensors=2**62), "claims 4611686018427387904 tensors"),
    (_gguf(tensors=[_tensor(dims=(1,) * 9)]), "has 9 dimensions"),
    (_gguf(tensors=[_tensor(dims=(2**40, 2**40))]), "ends at byte"),
    (_gguf(tensors=[_tensor(offset=2**63)]), "ends at byte"),
    (_gguf(tensors=[_tensor(ggml_type=999)]), "unknown ggml type 999"),
    (_gguf(tensors=[_tensor(dims=(33,), ggml_type=2)]), "33 elements are not whole blocks of 32"),
    (b"GGUF" + _u32(7) + bytes(40), "unsupported GGUF version"),
    (_gguf()[:30], "truncated"),
    (_gguf(tensors=[_tensor()], data=b""), "truncated"),
])
def test_crafted_gguf_headers_are_one_error_before_any_allocation(tmp_path, raw, message):
    import tracemalloc

    from tinyvllm.checkpoint.gguf_header import open_gguf
    path = tmp_path / "crafted.gguf"
    path.write_bytes(raw)
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError, match=message):
            open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated while refusing a {len(raw)}-byte file"


def test_header_check_accepts_a_real_file(tmp_path, tiny):
    from tinyvllm.checkpoint.gguf_header import check_header
    cfg, weights = tiny
    check_header(write_gguf(tmp_path / "m.gguf", cfg, weights))     # raises nothing
