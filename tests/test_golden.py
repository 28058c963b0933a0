"""The default model (SmolLM2-135M-Instruct, converted from its GGUF) against transformers:
tests/fixtures/smollm2_golden.json holds transformers' fp32 greedy tokens on the very directory
our conversion writes, recorded by benchmarks/hf_golden.py (its "how_it_was_made" says where).

  * numpy backend (fp32 maths on the same bf16 weights): every golden id, exactly;
  * cuda backend (bf16 activations): free-running, every golden id up to the first step whose
    fp32 top-2 gap is below the bf16 bound of bf16_gap_bound (a near-tie may flip, and all after
    it then differs); teacher-forced on every golden prefix, every step whose gap is not below it;
  * prompts: our encoding of every raw prompt and chat conversation equals transformers';
    tokenizer.json encodes every recorded string as transformers does;
  * the conversion itself: transformers' own GGUF loader agrees (tokenizer, chat template, and
    greedy ids up to the first near-tie), where the fixture was made with `gguf` installed.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_golden.json"
if not FIXTURE.is_file():
    pytest.skip(f"{FIXTURE.name} is absent: record it with benchmarks/hf_golden.py on a machine with "
                "torch + transformers (see that script's docstring)", allow_module_level=True)
GOLDEN = json.loads(FIXTURE.read_text(encoding="utf-8"))
CASES = GOLDEN["cases"]
SIGMAS = 5.0


@pytest.fixture(scope="module")
def model_dir(default_model_home):
    from tinyvllm.checkpoint.default_model import DEFAULT_MODEL
    return default_model_home / "models" / DEFAULT_MODEL


def bf16_gap_bound() -> float:
    """How far bf16 activations can move an fp32 top-2 logit gap: SIGMAS standard deviations of
    the gap errors of transformers' own bf16 run, recorded in the fixture for every step
    (teacher-forced on the golden tokens, so each step is a fresh sample).

    Why: bf16 keeps 8 significant bits, so every rounding of an activation errs by up to 2^-8 of
    it; after 30 layers of roundings, each logit carries the sum of many small independent
    errors, and the gap between two logits is off by a roughly Gaussian amount whose spread no
    first-principles count pins down (the layers amplify some errors and damp others). So the
    spread is measured on an independent bf16 implementation of the same model (sigma = RMS of
    its errors, ~0.11 logits for SmolLM2), and a step is a near-tie when its gap is below 5 sigma:
    a Gaussian passes 5 sigma once in 3.5 million steps, and transformers' own largest error over
    the fixture (4.5 sigma: the tails are heavier than Gaussian) stays inside, which
    test_bound_covers_transformers_own_bf16_run checks. Our kernels round at different points
    (fused projections, fp32 softmax), so the bound assumes an error spread like transformers';
    a difference the bound does not excuse is reported with its gap."""
    errors = np.concatenate([c["bf16_gap_error"] for c in CASES])
    return SIGMAS * float(np.sqrt(np.mean(errors ** 2)))


def first_near_tie(case: dict, bound: float) -> int:
    """The first step whose golden gap a bf16 run could flip (len if none)."""
    return next((i for i, g in enumerate(case["top2_gap"]) if g < bound), len(case["top2_gap"]))


def greedy(model_dir, device: str, max_tokens: int) -> list[list[int]]:
    from tinyvllm import LLM, SamplingParams
    options = {"num_kv_blocks": 256, "max_model_len": 4096} if device == "cpu" else {}
    llm = LLM(model_dir, device=device, max_num_seqs=len(CASES), **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in CASES], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_conversion_is_the_one_the_fixture_was_made_from(model_dir):
    for name, digest in GOLDEN["converted_files_sha256"].items():
        assert hashlib.sha256((model_dir / name).read_bytes()).hexdigest() == digest, \
            f"{name} differs from the converted file the fixture was recorded on: re-record it"


def test_numpy_reproduces_every_golden_id(model_dir):
    """fp32 maths on the same weights: only summation order differs from transformers."""
    for case, ours in zip(CASES, greedy(model_dir, "cpu", GOLDEN["max_new_tokens"])):
        golden = case["generated_ids"]
        first = next((i for i, (a, b) in enumerate(zip(ours, golden)) if a != b), None)
        assert first is None, (f"{case['name']}: step {first} gave {ours[first]}, golden "
                               f"{golden[first]} (golden top-2 gap {case['top2_gap'][first]:.2e})")


def test_tokenizer_json_encodes_like_transformers(model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for case in GOLDEN["tokenizer_cases"]:
        assert tok.encode(case["text"]).ids == case["ids"], repr(case["text"])


def test_prompts_encode_like_transformers(model_dir):
    from tinyvllm import LLM, SamplingParams
    llm = LLM(model_dir, device="cpu", num_kv_blocks=64, max_model_len=1024)
    one = SamplingParams(temperature=0, max_tokens=1)
    for case in CASES:
        out = llm.chat(case["messages"], one) if case["kind"] == "chat" else llm.generate(case["prompt_text"], one)
        assert list(out[0].prompt_token_ids) == case["prompt_ids"], case["name"]
    for conv in GOLDEN["chat_templates"]:
        if conv["add_generation_prompt"]:
            assert list(llm.chat(conv["messages"], one)[0].prompt_token_ids) == conv["ids"], conv["messages"]


def test_bound_covers_transformers_own_bf16_run():
    bound = bf16_gap_bound()
    worst = max(max(c["bf16_gap_error"]) for c in CASES)
    assert worst < bound, f"transformers' bf16 run moved a gap by {worst:.3f} >= the bound {bound:.3f}"
    print(f"bf16 bound {bound:.3f} logits; transformers' bf16 worst gap error {worst:.3f}")


def test_transformers_gguf_loader_agrees_with_the_conversion():
    check = GOLDEN["gguf_check"]
    if "skipped" in check:
        pytest.skip(f"the fixture has no GGUF cross-check: {check['skipped']}")
    assert check["tokenizer_cases_equal"] and check["chat_templates_equal"]
    for case, theirs in zip(CASES, check["cases"]):
        assert theirs["prompt_ids_equal"], case["name"]
    if "model_skipped" in check:
        pytest.skip(f"tokenizer agrees; no GGUF model cross-check in the fixture: {check['model_skipped']}")
    bound = bf16_gap_bound()      # their weights are not rounded to bf16: a smaller change
    for case, theirs in zip(CASES, check["cases"]):
        free_from = first_near_tie(case, bound)
        assert theirs["generated_ids"][:free_from] == case["generated_ids"][:free_from], case["name"]


def differences(case: dict, ours: list[int], bound: float) -> list[str]:
    """Steps where ours differs from the golden id although the golden gap is >= bound."""
    return [f"{case['name']} step {i}: ours {o}, golden {g} (golden gap {gap:.3f} >= bound {bound:.3f})"
            for i, (o, g, gap) in enumerate(zip(ours, case["generated_ids"], case["top2_gap"]))
            if o != g and gap >= bound]


@pytest.mark.gpu
def test_cuda_greedy_matches_golden_up_to_near_ties(model_dir):
    """Free-running greedy decoding on cuda: every id up to each case's first near-tie."""
    bound, lines, bad = bf16_gap_bound(), [], []
    for case, ours in zip(CASES, greedy(model_dir, "cuda", GOLDEN["max_new_tokens"])):
        golden, free_from = case["generated_ids"], first_near_tie(case, bound)
        first = next((i for i, (a, b) in enumerate(zip(ours, golden)) if a != b), None)
        lines.append(f"{case['name']}: {len(golden) if first is None else first}/{len(golden)} match"
                     + ("" if first is None else f", first difference at step {first} (golden gap "
                        f"{case['top2_gap'][first]:.3f})") + f"; near-tie free from step {free_from}")
        bad += differences(case, ours[:free_from], bound)
    print("\n".join(lines))
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
def test_cuda_next_token_after_every_golden_prefix(model_dir):
    """Teacher-forced: the greedy next token after the prompt and the first k golden ids, for
    every k, so each step is checked on its own (not only up to the first near-tie)."""
    from tinyvllm import LLM, SamplingParams
    llm = LLM(model_dir, device="cuda")
    prompts = [c["prompt_ids"] + c["generated_ids"][:k] for c in CASES for k in range(len(c["generated_ids"]))]
    outs = iter(llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)))
    bound, matched, total, bad, ties = bf16_gap_bound(), 0, 0, [], []
    for case in CASES:
        ours = [next(outs).outputs[0].token_ids[0] for _ in case["generated_ids"]]
        matched += sum(o == g for o, g in zip(ours, case["generated_ids"]))
        total += len(ours)
        bad += differences(case, ours, bound)
        ties += [f"{case['name']} step {i}: gap {gap:.3f}" for i, (o, g, gap) in
                 enumerate(zip(ours, case["generated_ids"], case["top2_gap"])) if o != g and gap < bound]
    print(f"cuda teacher-forced: {matched}/{total} golden ids; differences at near-ties: {ties}")
    assert not bad, "\n".join(bad)
