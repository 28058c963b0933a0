"""Each model family's whole forward pass on the GPU against the numpy reference model, on its
golden fixture's tiny checkpoint (tests/fixtures/families/): a prefill of three prompts longer
than the sliding windows, then 32 decode steps over shuffled block tables, compared every step,
on the fused decode layer and on the nine-launch one (EngineConfig.fused_decode=False).

As test_gpu_model.py for Llama: bf16 rounding noise grows through the layers, so the GPU is held
to the exact fp32 answer no less closely than the bf16 numpy twin (ReferenceModel(round_bf16=
True), rounding to bf16 exactly where the GPU stores bf16) is: the mean over the steps of the
GPU's relative logits error against fp32 is at most BF16_NOISE_RATIO times the twin's. Greedy
tokens agree with the twin's except where its top two logits are closer than twice that row's
largest logit error (a near-tie the rounding can flip).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.reference.model import ReferenceModel

pytestmark = pytest.mark.gpu
FIXTURES = Path(__file__).parent / "fixtures" / "families"
FAMILIES = ["gemma3", "mistral", "qwen2", "qwen3"]
BF16_NOISE_RATIO = 1.5
BLOCK = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    from tinyvllm.gpu.cuda_runner import CudaRunner
    folder = FIXTURES / request.param
    cfg = ModelConfig.from_pretrained(folder)
    weights = load_weights(folder, cfg)
    runner = CudaRunner(cfg, weights, EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, num_kv_blocks=64,
                                                    block_size=BLOCK, max_model_len=512))
    yield cfg, runner, ReferenceModel(cfg, weights, round_bf16=True), ReferenceModel(cfg, weights)
    runner.close()


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
def test_family_model_matches_reference(family_model, fused_decode):
    from gpu_helpers import decode_layer, logits_match_reference
    cfg, runner, refm, ref32 = family_model
    with decode_layer(runner, fused_decode):
        logits_match_reference(cfg, runner, refm, ref32, BLOCK, BF16_NOISE_RATIO)
