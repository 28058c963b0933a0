"""The default model's Q4_1 file with its blocks kept, on the numpy backend, against llama.cpp
itself (tests/fixtures/smollm2_llamacpp_golden.json, made by benchmarks/llama_cpp_golden.py):
teacher-forced on llama.cpp's greedy ids (one divergence does not derail the steps after it), our
argmax equals llama.cpp's id at every step except near-ties, the bound derived from llama.cpp's
8-bit rounding of activations (tinyvllm/quant/llama_cpp_twin.py); and that twin against a plain
element-by-element float64 version of llama.cpp's block dot products."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.block_format import QuantizedWeight
from tinyvllm.quant.gguf_legacy import Q4_0, Q4_1, Q8_0
from tinyvllm.quant.llama_cpp_twin import integer_form, llama_cpp_linear, quantize_activations, teacher_forced

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_llamacpp_golden.json"
GOLDEN = json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def q4_1_model(tmp_path_factory):
    pytest.importorskip("gguf")
    from tinyvllm.checkpoint.default_model import default_gguf_path
    from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks
    from tinyvllm.config import ModelConfig
    from tinyvllm.reference.model import ReferenceModel
    try:
        path = default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    assert (path.name, path.stat().st_size) == (GOLDEN["model_file"], GOLDEN["model_file_bytes"]), \
        "the installed default model is not the file the fixture was made from"
    config = ModelConfig.from_pretrained(gguf_model_dir(path, tmp_path_factory.mktemp("home")))
    return ReferenceModel(config, load_gguf_blocks(path, config))


def test_q4_1_blocks_agree_with_llama_cpp_up_to_near_ties(q4_1_model):
    assert isinstance(q4_1_model.layers[0]["gate_up"], QuantizedWeight)
    agreed, steps, unexplained, near_ties = 0, 0, [], []
    for run in GOLDEN["runs"]:
        forced = teacher_forced(q4_1_model, run["prompt_ids"], run["generated_ids"])
        for step, theirs in enumerate(run["generated_ids"]):
            steps += 1
            if int(forced.logits[step].argmax()) == theirs:
                agreed += 1
                continue
            gap, forgiven = forced.forgiven(step, theirs)
            line = (f"{run['prompt'][-24:]!r} step {step}: ours {int(forced.logits[step].argmax())}, "
                    f"llama.cpp {theirs}, our gap {gap:.4f}, 2 delta_t {2 * forced.delta[step]:.4f}")
            (near_ties if forgiven else unexplained).append(line)
    print(f"teacher-forced: {agreed}/{steps} steps equal to llama.cpp; near-ties:", *near_ties, sep="\n  ")
    assert not unexplained, "divergences from llama.cpp beyond the near-tie bound:\n" + "\n".join(unexplained)


def plain_llama_cpp_dot(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """llama.cpp's block dot products element by element in float64: each block of x to int8
    with D = amax / 127 (fp16-stored), the integer sums exact, then scaled (and Q4_1's m * s)."""
    rows, cols = weight.shape
    raw = weight.blocks.reshape(rows, cols // 32, weight.format.block_bytes)
    out = np.zeros((x.shape[0], rows))
    for i in range(x.shape[0]):
        for b in range(cols // 32):
            xb = x[i, 32 * b:32 * b + 32].astype(np.float32)
            amax = np.float32(np.abs(xb).max())
            d = amax / np.float32(127)
            q = np.rint(xb * (np.float32(127) / amax)) if amax else np.zeros(32, np.float32)
            d16 = float(np.float16(d))
            s16 = float(np.float16(d * np.float32(q.sum())))
            for r in range(rows):
                block = raw[r, b]
                dw = float(block[0:2].view("<f2")[0])
                if weight.format is Q8_0:
                    codes = block[2:34].view(np.int8).astype(np.int64)
                else:
                    packed = block[2:18] if weight.format is Q4_0 else block[4:20]
                    codes = np.concatenate([packed & 15, packed >> 4]).astype(np.int64)
                    codes -= 8 if weight.format is Q4_0 else 0
                total = dw * d16 * float(np.dot(codes, q.astype(np.int64)))
                if weight.format is Q4_1:
                    total += float(block[2:4].view("<f2")[0]) * s16
                out[i, r] += total
    return out


@pytest.mark.parametrize("fmt", [Q8_0, Q4_0, Q4_1], ids=lambda f: f.name)
def test_the_twin_is_llama_cpps_block_dot_product(rng, fmt):
    """Vectorized (scaled factors summed in float32) against the plain version: equal up to
    float32 rounding of the reordered sum, gamma_n of the sum of |terms| over its n terms."""
    from test_quant_gguf import random_raw
    rows, cols = 5, 96
    weight = QuantizedWeight(fmt, (rows, cols), random_raw(fmt, rows, cols, seed=int(rng.integers(1 << 30))))
    x = rng.normal(size=(3, cols)).astype(np.float32) * rng.choice([1e-3, 1.0, 40.0], size=(3, 1)).astype(np.float32)
    x[0, :32] = 0                                        # an all-zero block: D = 0, no division
    ours, plain = llama_cpp_linear(x, weight).astype(np.float64), plain_llama_cpp_dot(x, weight)
    q, dx, sx = quantize_activations(x)
    codes, dw, mw = integer_form(weight)
    terms = np.abs(q * dx[:, :, None]).reshape(3, -1) @ np.abs(codes * dw[:, :, None]).reshape(rows, -1).T
    if mw is not None:
        terms += np.abs(sx) @ np.abs(mw).T
    n = cols + cols // 32 + 1              # products of the two matmuls and the one addition
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24) + 2.0 ** -50   # float32; the float64 side's own
    assert np.all(np.abs(ours - plain) <= gamma * terms)


def test_activation_blocks_round_to_half_a_step(rng):
    x = rng.normal(size=(4, 64)).astype(np.float32) * np.float32(3)
    q, d16, _ = quantize_activations(x)
    assert np.all(np.abs(q) <= 127) and np.array_equal(q, np.rint(q))
    amax = np.abs(x.reshape(4, 2, 32)).max(axis=2)
    step = amax / 127
    assert np.all(np.abs(q * step[:, :, None] - x.reshape(4, 2, 32)) <= step[:, :, None] / 2 * (1 + 2 ** -20))
    assert np.all(np.abs(d16 - step) <= step * 2 ** -11)
