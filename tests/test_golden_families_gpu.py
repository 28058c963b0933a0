"""The model families on cuda against transformers' golden ids (tests/fixtures/families/, see
test_golden_families.py), as test_golden.py holds SmolLM2 on cuda:

  * teacher-forced on both decode layers (the fused one and EngineConfig.fused_decode=False): each
    case's prompt is prefilled, then every golden id is fed back through decode steps, so every
    step's greedy token is checked on its own, from the prefill's logits and from each decode
    step's; block sizes 16 and 4 (windows then start inside blocks);
  * free-running greedy decoding through the engine (CUDA graphs), every id up to each case's
    first near-tie.
A step may differ from the golden id only where the golden fp32 top-2 gap is below the bf16
bound: SIGMAS standard deviations of the gap errors of transformers' own bf16 run, recorded in
each fixture for every step (test_golden.py's bf16_gap_bound says why).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
FIXTURES = Path(__file__).parent / "fixtures" / "families"
FAMILIES = ["gemma3", "gemma3_mm", "mistral", "mistral3_mm", "phi3", "qwen2", "qwen2_5_vl", "qwen3", "qwen3_vl",
            "qwen3_yarn", "smollm3"]
SIGMAS = 5.0


def golden(family: str) -> dict:
    return json.loads((FIXTURES / family / "golden.json").read_text(encoding="utf-8"))


def bf16_gap_bound(fixture: dict) -> float:
    errors = np.concatenate([c["bf16_gap_error"] for c in fixture["cases"]])
    return SIGMAS * float(np.sqrt(np.mean(errors ** 2)))


def differences(case: dict, ours: list[int], bound: float) -> list[str]:
    """Steps where ours differs from the golden id although the golden gap is >= bound."""
    return [f"{case['name']} step {i}: ours {o}, golden {g} (golden gap {gap:.3f} >= bound {bound:.3f})"
            for i, (o, g, gap) in enumerate(zip(ours, case["generated_ids"], case["top2_gap"]))
            if o != g and gap >= bound]


def teacher_forced_ids(family: str, fused_decode: bool, block_size: int) -> list[list[int]]:
    """The greedy id of every golden step, each case's prompt prefilled (its first id) and then
    every golden id fed back one decode step at a time, all cases in one batch."""
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import EngineConfig, ModelConfig
    from tinyvllm.engine.batch import ForwardBatch
    from tinyvllm.gpu.cuda_runner import CudaRunner
    from tinyvllm.gpu.step_shape import StepShape
    cases = golden(family)["cases"]
    config = ModelConfig.from_pretrained(FIXTURES / family)
    runner = CudaRunner(config, load_weights(FIXTURES / family, config),
                        EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=512,
                                     block_size=block_size, max_model_len=256, fused_decode=fused_decode,
                                     enforce_eager=True))
    try:
        assert runner.model.fused(StepShape(len(cases), len(cases), is_prefill=False)) == fused_decode
        steps = len(cases[0]["generated_ids"])
        lens = [len(c["prompt_ids"]) for c in cases]
        per_seq = -(-(max(lens) + steps) // block_size)
        tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(len(cases))]   # scattered pages
        batch = ForwardBatch.build([c["prompt_ids"] for c in cases], lens, tables, block_size, is_prefill=True)
        ours = [[] for _ in cases]
        for step in range(steps):
            logits = runner.forward_logits(batch)
            for i, row in enumerate(logits):
                ours[i].append(int(np.argmax(row)))
            lens = [n + 1 for n in lens]
            fed = [[c["generated_ids"][step]] for c in cases]
            batch = ForwardBatch.build(fed, lens, tables, block_size, is_prefill=False)
        return ours
    finally:
        runner.close()


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_teacher_forced_matches_golden(family, fused_decode, block_size):
    fixture = golden(family)
    bound, bad, ties, matched, total = bf16_gap_bound(fixture), [], [], 0, 0
    for case, ours in zip(fixture["cases"], teacher_forced_ids(family, fused_decode, block_size)):
        want = case["generated_ids"]
        matched += sum(o == g for o, g in zip(ours, want))
        total += len(want)
        bad += differences(case, ours, bound)
        ties += [f"{case['name']} step {i} (gap {gap:.3f})" for i, (o, g, gap) in
                 enumerate(zip(ours, want, case["top2_gap"])) if o != g and gap < bound]
    print(f"{family} cuda teacher-forced ({'fused' if fused_decode else 'nine-launch'} decode, block {block_size}): "
          f"{matched}/{total} golden ids, bf16 bound {bound:.3f}; differences at near-ties: {ties}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_greedy_matches_golden_up_to_near_ties(family, fused_decode):
    """The engine on cuda (decode graphs), free-running: every id up to each case's first near-tie."""
    from tinyvllm import LLM, SamplingParams
    fixture = golden(family)
    bound, bad, lines = bf16_gap_bound(fixture), [], []
    llm = LLM(FIXTURES / family, device="cuda", max_num_seqs=8, max_model_len=256, kv_cache_gb=0.05,
              fused_decode=fused_decode)
    params = SamplingParams(temperature=0, max_tokens=fixture["max_new_tokens"], ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in fixture["cases"]], params)
    for case, out in zip(fixture["cases"], outputs):
        ours, want = list(out.outputs[0].token_ids), case["generated_ids"]
        free_from = next((i for i, g in enumerate(case["top2_gap"]) if g < bound), len(want))
        first = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
        lines.append(f"{case['name']}: {len(want) if first is None else first}/{len(want)} match; "
                     f"near-tie free from step {free_from}")
        bad += differences(case, ours[:free_from], bound)
    print(f"{family} cuda free-running ({'fused' if fused_decode else 'nine-launch'}):", *lines, sep="\n")
    assert not bad, "\n".join(bad)
