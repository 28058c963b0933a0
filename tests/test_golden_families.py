"""Qwen2, Qwen3, SmolLM3, Phi-3, Mistral and Gemma 3 against transformers: tests/fixtures/families/<family>/ holds
a small random-weight checkpoint that transformers built from the family's own config class, and
transformers' fp32 greedy ids on it (golden.json), recorded by benchmarks/hf_family_golden.py.

The numpy backend (fp32 maths on the same bf16 weights) must give every golden id, with one
exception: a step whose golden top-2 gap is a near-tie for fp32 (fp32_gap_bound) may flip, and
the comparison of that prompt stops there, since every later step then has another context.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "families"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.json").is_file()) if FIXTURES.is_dir() else []
SIGMAS = 5.0
RATIO = 2.0          # our fp32 error's spread over transformers', at most (checked below)
# the engine at its defaults, and with 4-token blocks and 16-token prefill chunks, so that
# windows start inside blocks and long prompts are prefilled in pieces that attend to the cache
ENGINES = {"default": {}, "small-blocks-chunked": {"block_size": 4, "max_num_batched_tokens": 16}}


def golden(family: str) -> dict:
    return json.loads((FIXTURES / family / "golden.json").read_text(encoding="utf-8"))


def fp32_gap_bound(fixture: dict) -> float:
    """How far our fp32 logit gap and transformers' can disagree: SIGMAS * sqrt(1 + RATIO^2) *
    sigma, sigma the RMS over the fixture of transformers' fp32 error (its fp32 gap minus the
    float64 run's, both recorded for every step).

    Why: fp32 keeps 24 significant bits; every sum and product in the forward pass errs by a
    few units of 2^-24 of its size, and each logit ends up carrying the sum of many such small
    errors, so the error of a gap is roughly Gaussian, with a spread set by how much the model
    amplifies them (~1e-5 logits here: logits of std ~4 out of a final norm of gain 18).
    transformers' error is measured against its float64 run (RoPE included: the script computes
    the float64 model's angles in float64, which transformers does in fp32). Ours is another fp32
    computation with other summation orders and rounding points, an independent error whose
    spread is at most RATIO times transformers' (test_our_fp32_error_is_like_transformers
    measures it: 1.1 to 1.6 times), so ours minus theirs has a spread of at most sqrt(1 + RATIO^2)
    * sigma, and a golden gap below SIGMAS times that could flip: a Gaussian passes 5 sigma
    once in 3.5 million steps."""
    errors = np.array([g - e for c in fixture["cases"] for g, e in zip(c["top2_gap"], c["fp64_gap"])])
    return SIGMAS * math.sqrt(1.0 + RATIO ** 2) * float(np.sqrt(np.mean(errors ** 2)))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


_RUNS: dict = {}


def numpy_outputs(family: str, engine: str):
    """The engine's greedy outputs on every golden prompt (numpy backend), run once."""
    if (family, engine) not in _RUNS:
        from tinyvllm import LLM, SamplingParams
        fixture = golden(family)
        llm = LLM(FIXTURES / family, device="cpu", max_num_seqs=len(fixture["cases"]), max_model_len=256,
                  num_kv_blocks=256, **ENGINES[engine])
        params = SamplingParams(temperature=0, max_tokens=fixture["max_new_tokens"], ignore_eos=True)
        _RUNS[family, engine] = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in fixture["cases"]],
                                             params)
    return _RUNS[family, engine]


def test_every_family_has_a_fixture():
    assert FAMILIES == ["gemma3", "gemma3_mm", "mistral", "mistral3_mm", "phi3", "qwen2", "qwen2_5_vl", "qwen3",
                        "qwen3_vl", "qwen3_yarn", "smollm3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_files_are_the_ones_the_golden_ids_were_made_from(family):
    for name, digest in golden(family)["files_sha256"].items():
        assert sha256(FIXTURES / family / name) == digest, f"{family}/{name} changed: re-record the fixture"


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("family", FAMILIES)
def test_numpy_reproduces_every_golden_id(family, engine):
    """Every golden id, a difference allowed only at a near-tie (and nothing compared after it)."""
    fixture = golden(family)
    bound, matched, total, lines = fp32_gap_bound(fixture), 0, 0, []
    for case, out in zip(fixture["cases"], numpy_outputs(family, engine)):
        ours, want = list(out.outputs[0].token_ids), case["generated_ids"]
        assert len(ours) == len(want), case["name"]
        first = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
        total += len(want)
        matched += len(want) if first is None else first
        if first is not None:
            gap = case["top2_gap"][first]
            assert gap < bound, (f"{case['name']} step {first}: ours {ours[first]}, golden {want[first]}; "
                                 f"golden top-2 gap {gap:.2e} is not a near-tie (bound {bound:.2e})")
            lines.append(f"{case['name']}: flipped at the near-tie of step {first} (gap {gap:.2e})")
    print(f"{family} ({engine}): {matched}/{total} golden ids, near-tie bound {bound:.2e}", *lines, sep="\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_text_is_transformers_decoding(family):
    """Where every id matched, the streamed text is transformers' decode (special tokens skipped);
    at least one case of each family matches (the near-tie flips the test above allows are few)."""
    fixture = golden(family)
    compared = 0
    for case, out in zip(fixture["cases"], numpy_outputs(family, "default")):
        if list(out.outputs[0].token_ids) == case["generated_ids"]:
            assert out.outputs[0].text == case["text"], case["name"]
            compared += 1
    assert compared >= 1, f"{family}: no case's ids matched the golden run, so no text was compared"


@pytest.mark.parametrize("family", FAMILIES)
def test_our_fp32_error_is_like_transformers(family):
    """The premises of the near-tie bound, teacher-forced on every golden step: our own fp32
    error (our gap minus the float64 run's) has a spread within RATIO of transformers', and our
    gap minus transformers' stays below the bound."""
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    from tinyvllm.reference.model import ReferenceModel
    fixture = golden(family)
    config = ModelConfig.from_pretrained(FIXTURES / family)
    model = ReferenceModel(config, load_weights(FIXTURES / family, config))
    bound, ours_vs_theirs, ours_vs_exact, theirs_vs_exact = fp32_gap_bound(fixture), [], [], []
    for case in fixture["cases"]:
        prompt, generated = case["prompt_ids"], case["generated_ids"]
        logits = model.forward_full(prompt + generated[:-1])[len(prompt) - 1:]
        for row, (a, b), gap, exact in zip(logits, case["top2_ids"], case["top2_gap"], case["fp64_gap"]):
            ours = float(row[a]) - float(row[b])
            ours_vs_theirs.append(ours - gap)
            ours_vs_exact.append(ours - exact)
            theirs_vs_exact.append(gap - exact)
    worst = max(map(abs, ours_vs_theirs))
    rms_ours, rms_theirs = (float(np.sqrt(np.mean(np.square(e)))) for e in (ours_vs_exact, theirs_vs_exact))
    print(f"{family}: ours - transformers worst {worst:.2e} (bound {bound:.2e}); fp32 error RMS ours "
          f"{rms_ours:.2e}, transformers {rms_theirs:.2e}")
    assert rms_theirs / RATIO < rms_ours < RATIO * rms_theirs
    assert worst < bound


@pytest.mark.parametrize("family", FAMILIES)
def test_no_golden_step_is_a_near_tie(family):
    """The fixture's weights were drawn so that greedy decoding is varied and no top-2 gap is a
    near-tie: every golden id is then held to exactly, none excused."""
    fixture = golden(family)
    bound = fp32_gap_bound(fixture)
    gaps = [g for c in fixture["cases"] for g in c["top2_gap"]]
    assert min(gaps) > bound, f"smallest golden gap {min(gaps):.2e}, bound {bound:.2e}"
    assert all(len(set(c["generated_ids"])) >= 5 for c in fixture["cases"])      # not a loop of a few ids
