"""Quantized weights in a model: GGUF files loaded with their blocks kept (checkpoint/gguf_blocks.py)
against convert-gguf's conversion of the same file, the reference model's linear and embedding on
every weight kind (quant/weight_kinds.py), the engine on the numpy backend with FP8 and GGUF
weights, inspect's bytes, and the CUDA backend's one-line refusal."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_helpers import tiny_hf_config, tiny_hf_weights, tiny_vocab, write_gguf  # noqa: E402
from test_quant_gguf import random_raw  # noqa: E402

from tinyvllm.checkpoint.gguf import convert_gguf  # noqa: E402
from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks  # noqa: E402
from tinyvllm.checkpoint.weight_names import EMBED, fused_layer  # noqa: E402
from tinyvllm.checkpoint.weights import load_weights  # noqa: E402
from tinyvllm.config import EngineConfig, ModelConfig  # noqa: E402
from tinyvllm.errors import ModelLoadError  # noqa: E402
from tinyvllm.quant import block_format  # noqa: E402
from tinyvllm.quant.block_format import QuantizedWeight  # noqa: E402
from tinyvllm.quant.fp8 import Fp8Weight  # noqa: E402
from tinyvllm.quant.weight_kinds import (  # noqa: E402
    BLOCK_FORMATS,  # noqa: E402
    RowStack,
    bytes_by_kind,
    concat_rows,
    linear,
)
from tinyvllm.reference.kernels import embedding  # noqa: E402
from tinyvllm.reference.model import ReferenceModel  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
KEPT = ["Q8_0", "Q4_0", "Q4_1"]          # the kept formats gguf's writer can quantize


@pytest.fixture(scope="module")
def tiny():
    tokens, _, _ = tiny_vocab()
    cfg = tiny_hf_config(len(tokens))
    return cfg, tiny_hf_weights(cfg)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def family_file(tmp_path, family: str, qtype: str):
    """(path, HF weights) of a tiny GGUF file of llama.cpp's architecture `family`."""
    tokens, _, _ = tiny_vocab()
    kwargs = {}
    if family == "gemma3":
        from test_gguf_families import _gemma3_file
        cfg, kwargs = _gemma3_file(tmp_path)
    elif family in ("qwen2", "qwen3"):
        model = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
        cfg = tiny_hf_config(len(tokens), architectures=[model], model_type=family)
        kwargs = dict(arch=family, tokenizer_pre="qwen2")
    else:
        cfg = tiny_hf_config(len(tokens))
    weights = tiny_hf_weights(cfg)
    return write_gguf(tmp_path / "m.gguf", cfg, weights, qtype=qtype, **kwargs), weights


FILES = [("llama", q) for q in KEPT] + [("qwen2", "Q8_0"), ("qwen3", "Q4_1"), ("gemma3", "Q4_0")]


@pytest.mark.parametrize("family,qtype", FILES, ids=[f"{f}-{q}" for f, q in FILES])
def test_blocks_dequantize_to_the_bf16_conversion_of_the_same_file(tmp_path, home, family, qtype):
    """Names, shapes and the layout changes (llama's q/k row order undone on the block rows,
    Gemma 3's norms): every matrix kept as blocks dequantizes to exactly what convert-gguf
    writes (gguf's dequantization, put back in HF layout, rounded to bf16), and the 1-D tensors
    (norms, Qwen2's biases) are the file's float32 values, which round to the conversion's."""
    path, weights = family_file(tmp_path, family, qtype)
    converted = convert_gguf(path, tmp_path / "hf")
    config = ModelConfig.from_pretrained(gguf_model_dir(path))
    assert config == ModelConfig.from_pretrained(converted)
    blocks = load_gguf_blocks(path, config)
    bf16 = load_weights(converted, config)
    assert blocks.keys() == bf16.keys() == weights.keys()
    for name, w in blocks.items():
        if isinstance(w, np.ndarray):                 # the norms and biases
            assert w.dtype == np.float32 and w.ndim == 1, name
            np.testing.assert_array_equal(w.astype(BF16).view(np.uint16), bf16[name].view(np.uint16), err_msg=name)
            continue
        assert isinstance(w, QuantizedWeight) and w.format.name == qtype, name
        assert w.shape == weights[name].shape
        np.testing.assert_array_equal(w.dequantize_bf16().view(np.uint16), bf16[name].view(np.uint16), err_msg=name)


def test_the_config_and_tokenizer_directory_is_made_once_and_remade_when_the_file_changes(tmp_path, tiny, home):
    cfg, weights = tiny
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype="Q8_0")
    first = gguf_model_dir(path)
    assert first.parent == home / "gguf" and not (first / "model.safetensors").exists()
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "generation_config.json",
                                                      "tinyvllm-converted.json", "tokenizer.json",
                                                      "tokenizer_config.json"]
    stamp = (first / "tinyvllm-converted.json").read_text()
    assert gguf_model_dir(path) == first and (first / "tinyvllm-converted.json").read_text() == stamp
    write_gguf(path, tiny_hf_config(cfg["vocab_size"], rms_norm_eps=1e-6), weights, qtype="Q8_0")
    assert gguf_model_dir(path) == first and ModelConfig.from_pretrained(first).rms_norm_eps == 1e-6


def test_a_type_that_is_not_kept_is_one_error_naming_convert_gguf(tmp_path, tiny, home):
    cfg, weights = tiny
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype="Q5_0")
    with pytest.raises(ModelLoadError, match=r"'token_embd.weight' is Q5_0; tinyvllm runs Q8_0, Q4_0, Q4_1, "
                                             r"Q4_K, Q6_K blocks as they are: convert the file to bf16"):
        load_gguf_blocks(path, ModelConfig.from_pretrained(gguf_model_dir(path)))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_the_engine_serves_a_gguf_file_with_its_blocks(tmp_path, tiny, home, qtype):
    """LLM(FILE.gguf) on the numpy backend: greedy ids equal the reference model's own greedy
    run on the blocks (the engine path: tokenizer, scheduler, paged cache, sampler), the tied LM
    head is the quantized embedding, and the prompt encodes as the converted tokenizer does."""
    from tinyvllm import LLM, SamplingParams
    cfg, weights = tiny
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype=qtype)
    llm = LLM(str(path), device="cpu", num_kv_blocks=32, max_model_len=256)
    model = llm.engine.runner.model
    assert isinstance(model.embed, QuantizedWeight) and model.lm_head is model.embed
    assert isinstance(model.layers[0]["qkv"], QuantizedWeight) and model.layers[0]["qkv"].shape == (128, 64)
    out = llm.generate("hello the world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    config = ModelConfig.from_pretrained(gguf_model_dir(path))
    reference = ReferenceModel(config, load_gguf_blocks(path, config))
    assert list(out.outputs[0].token_ids) == reference.greedy_generate(out.prompt_token_ids, 12)
    converted = LLM(str(convert_gguf(path, tmp_path / "hf")), device="cpu", num_kv_blocks=32, max_model_len=256)
    assert converted.generate("hello the world", SamplingParams(max_tokens=1))[0].prompt_token_ids == out.prompt_token_ids


def test_a_quantized_tied_lm_head_is_the_blocks_linear(tmp_path, tiny, home):
    """forward_full's logits are bf16(h) . bf16(dequantized embedding) in float32: the tied
    LM head runs block_format.linear on the Q8_0 table itself."""
    cfg, weights = tiny
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype="Q8_0")
    config = ModelConfig.from_pretrained(gguf_model_dir(path))
    model = ReferenceModel(config, load_gguf_blocks(path, config))
    ids = np.array([3, 270, 17, 99, 5])
    hidden = model.hidden_full(ids)
    expected = hidden.astype(BF16).astype(np.float32) @ model.embed.dequantize_bf16().astype(np.float32).T
    np.testing.assert_array_equal(model.forward_full(ids), expected)


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_a_quantized_embedding_dequantizes_the_rows_looked_up(name):
    fmt = BLOCK_FORMATS[name]
    table = QuantizedWeight(fmt, (40, fmt.block_elements * 2), random_raw(fmt, 40, fmt.block_elements * 2, seed=4))
    ids = np.array([39, 0, 7, 7, -1, 40, 12])
    rows = embedding(ids, table)
    full = table.dequantize()
    valid = (ids >= 0) & (ids < 40)
    np.testing.assert_array_equal(rows[valid], full[ids[valid]])
    assert not rows[~valid].any()


def test_fused_groups_of_every_kind(rng):
    """concat_rows: blocks of one format stack into one QuantizedWeight, mixed formats into a
    RowStack, FP8 parts into one Fp8Weight with a scale per row; each fused linear equals its
    parts' linears side by side, bit for bit (a mixed group's parts dequantized, as its GPU kind
    EXPANDED computes them)."""
    x = rng.normal(size=(3, 256)).astype(np.float32)
    q4k, q6k, q8 = (QuantizedWeight(BLOCK_FORMATS[n], (r, 256), random_raw(BLOCK_FORMATS[n], r, 256, seed=s))
                    for n, r, s in (("Q4_K", 16, 1), ("Q6_K", 8, 2), ("Q8_0", 8, 3)))
    same = concat_rows([q8, q8], ["a", "b"])
    assert isinstance(same, QuantizedWeight) and same.shape == (16, 256)
    mixed = concat_rows([q4k, q4k, q6k], ["q", "k", "v"])
    assert isinstance(mixed, RowStack) and mixed.shape == (40, 256) and mixed.nbytes == 2 * q4k.nbytes + q6k.nbytes
    fp8 = [Fp8Weight(rng.normal(size=(r, 256)).astype(ml_dtypes.float8_e4m3fn), np.asarray(s, np.float32))
           for r, s in ((16, 0.5), (8, 0.25))]
    fused_fp8 = concat_rows(fp8, ["q", "k"])
    assert fused_fp8.per_channel and fused_fp8.scale.tolist() == [0.5] * 16 + [0.25] * 8
    for fused, parts in ((same, [q8, q8]), (fused_fp8, fp8)):
        np.testing.assert_array_equal(linear(x, fused), np.concatenate([linear(x, p) for p in parts], axis=1))
    # a mixed group is the GPU's EXPANDED kind, which rounds every weight to bf16 (no factored GEMV)
    np.testing.assert_array_equal(linear(x, mixed), np.concatenate(
        [block_format.linear_dequantized(x, p) for p in (q4k, q4k, q6k)], axis=1))
    np.testing.assert_array_equal(linear(x, q8), block_format.linear(x, q8))
    with pytest.raises(ModelLoadError, match="mixes FP8 and unquantized parts"):
        concat_rows([fp8[0], np.zeros((8, 256), BF16)], ["q", "k"])
    assert bytes_by_kind({"a": mixed, "b": fp8[0]}) == {"Q4_K": (2, 2 * q4k.nbytes), "Q6_K": (1, q6k.nbytes),
                                                        "FP8": (1, fp8[0].nbytes)}


def test_the_engine_runs_online_fp8(tiny_model_dir):
    """LLM(..., quantization="fp8") quantizes at load and its greedy ids are the reference
    model's on the same Fp8Weight linears."""
    from tinyvllm import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32, max_model_len=256, quantization="fp8")
    layer = llm.engine.runner.model.layers[1]
    assert isinstance(layer["qkv"], Fp8Weight) and isinstance(layer["down"], Fp8Weight)
    out = llm.generate("The capital of France", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    config = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_weights(tiny_model_dir, config, "fp8")
    assert weights[EMBED].dtype == BF16 and isinstance(fused_layer(weights, 0, "gate_up", config), Fp8Weight)
    assert list(out.outputs[0].token_ids) == ReferenceModel(config, weights).greedy_generate(out.prompt_token_ids, 8)


def test_cuda_refuses_only_the_kinds_it_has_no_kernels_for(tmp_path, tiny, tiny_model_dir, home):
    """FP8 and GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K run on the CUDA backend (cuda/gemv_quant.cu), and
    so does a fused group of blocks in mixed formats; a group mixing blocks with FP8 is refused in one
    line before any CUDA start, --device cpu offered."""
    from tinyvllm.engine.runners import make_runner
    from tinyvllm.quant.gguf_kquants import Q4_K, Q6_K
    from tinyvllm.quant.weight_kinds import cuda_unsupported
    config = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_weights(tiny_model_dir, config, "fp8")
    assert cuda_unsupported(weights) is None
    cfg, w = tiny
    for qtype in KEPT:
        path = write_gguf(tmp_path / f"m-{qtype}.gguf", cfg, w, qtype=qtype)
        assert cuda_unsupported(load_gguf_blocks(path, ModelConfig.from_pretrained(gguf_model_dir(path)))) is None
    q4_k = QuantizedWeight.from_raw(Q4_K, (2, 256), random_raw(Q4_K, 2, 256, 0), "k")
    q6_k = QuantizedWeight.from_raw(Q6_K, (2, 256), random_raw(Q6_K, 2, 256, 0), "v")
    assert cuda_unsupported({"k": q4_k, "v": q6_k, "kv": RowStack((q4_k, q6_k))}) is None
    mixed = RowStack((weights[next(n for n, v in weights.items() if isinstance(v, Fp8Weight))], q4_k))
    assert cuda_unsupported({"m": mixed}) == "FP8+Q4_K (a fused group mixing blocks with other kinds)"
    with pytest.raises(ModelLoadError, match=r"no kernels for FP8\+Q4_K \(a fused group mixing blocks with other "
                                             r"kinds\) weights \(it reads bf16, FP8, and GGUF Q8_0, Q4_0, Q4_1, "
                                             r"Q4_K and Q6_K blocks.*\): serve the model with --device cpu"):
        make_runner(config, {**weights, "extra": mixed}, EngineConfig(device="cuda"))
    from tinyvllm import LLM
    path = write_gguf(tmp_path / "m.gguf", cfg, w, qtype="Q4_1")
    with pytest.raises(ModelLoadError, match="a GGUF file runs at its own precision"):
        LLM(str(path), device="cpu", quantization="fp8")


def test_quantization_option_is_validated():
    with pytest.raises(ValueError, match="quantization must be 'fp8' or None, got 'int4'"):
        EngineConfig(quantization="int4")
    from tinyvllm.cli import main
    assert main(["generate", "--device", "cpu", "--quantization", "int4", "x"]) == 2


def test_inspect_counts_quantized_bytes(tmp_path, tiny, tiny_model_dir, home):
    from tinyvllm.model_report import inspect_report
    cfg, weights = tiny
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype="Q4_0")
    report = inspect_report(path, EngineConfig(max_model_len=256))
    blocks = load_gguf_blocks(path, ModelConfig.from_pretrained(gguf_model_dir(path)))
    q4 = sum(w.nbytes for w in blocks.values() if isinstance(w, QuantizedWeight))
    assert "weights as loaded (GGUF Q4_0 blocks):" in report and f"{'Q4_0':<12}{len(blocks) - 5:>8}{q4:>16,}" in report
    assert "GGUF tensors (the file's tensor table):" in report
    from tinyvllm.gpu.device_weights import device_weight_bytes
    device = device_weight_bytes(ModelConfig.from_pretrained(gguf_model_dir(path)), blocks)
    assert f"weights allocation: {device:,} bytes" in report       # the planes' bytes, not bf16's
    assert re.search(r"layers\[0\]\.qkv\s+Q4_0\s", report) and "no kernels for" not in report
    report = inspect_report(tiny_model_dir, EngineConfig(max_model_len=256, quantization="fp8"))
    config = ModelConfig.from_pretrained(tiny_model_dir)
    fp8 = [w for w in load_weights(tiny_model_dir, config, "fp8").values() if isinstance(w, Fp8Weight)]
    assert f"{'FP8':<12}{len(fp8):>8}{sum(w.nbytes for w in fp8):>16,}" in report
