"""Mixed steps on the CUDA backend: a small token budget and staggered arrivals make steps that
hold decode rows beside prompt chunks (one prefill-kind forward, each decode row a one-token
query mid-sequence), between decode-only steps that replay the captured graphs. Greedy tokens
must be those of each request run alone by the fp32 numpy reference, and those of the same
engine without async scheduling, up to a bf16 near-tie (test_gpu_engine's module docstring and
its assert_same_greedy)."""
from __future__ import annotations

import numpy as np
import pytest
from test_gpu_engine import assert_same_greedy
from test_mixed_steps import run_engine

from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.reference.model import ReferenceModel

pytestmark = pytest.mark.gpu
BUDGET = 32          # tokens per step: prompts of up to 100 tokens are chunked beside decode rows


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    refm = ReferenceModel(cfg, load_weights(tiny_model_dir, cfg))
    rng = np.random.default_rng()
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (3, 40, 17, 100, 9, 64, 5, 33, 70, 12)]
    return refm, prompts


def _requests(prompts):
    return [(str(i), p, SamplingParams(temperature=0, ignore_eos=True, max_tokens=10 + 2 * i))
            for i, p in enumerate(prompts)]


def _run(model_dir, requests, **options):
    """-> (each request's greedy tokens, the StepLog, decode-only steps (scheduled or launched
    ahead: the captured graphs), preemptions)."""
    engine = LLMEngine(model_dir, device="cuda", max_num_seqs=8, max_num_batched_tokens=BUDGET,
                       max_model_len=128, **options)
    try:
        finals, log = run_engine(engine, requests, every=2)
        decode_only = sum(not is_prefill for is_prefill, _, _ in log.steps)
        return {k: list(v.token_ids) for k, v in finals.items()}, log, decode_only, engine.num_preemptions
    finally:
        engine.close()


# the schedule depends on lengths alone: on the numpy backend these settings preempt with 12
# blocks of 16 tokens and never with 64
@pytest.mark.parametrize("num_kv_blocks", [64, 12])          # roomy, preempting
def test_mixed_steps_on_cuda_give_each_request_its_tokens_alone(reference, tiny_model_dir, num_kv_blocks):
    refm, prompts = reference
    requests = _requests(prompts)
    tokens, log, decode_only, preemptions = _run(tiny_model_dir, requests, num_kv_blocks=num_kv_blocks)
    assert log.num_mixed > 0 and decode_only > 0
    assert any(n < len(s.prompt_token_ids) and decode for _, decode, prompt in log.steps for s, n in prompt), \
        "a prompt was meant to be chunked beside decode rows"
    assert (preemptions > 0) == (num_kv_blocks == 12)
    diverged = [assert_same_greedy(refm, p, tokens[rid], refm.greedy_generate(p, sp.max_tokens), f"request {rid}")
                for rid, p, sp in requests]
    print(f"near-tie divergences (mixed steps vs alone, fp32): {sum(d is not None for d in diverged)} of {len(requests)}")


def test_mixed_steps_on_cuda_with_and_without_async_scheduling(reference, tiny_model_dir):
    """Steps launched ahead, mixed ones among them (their decode rows' ids read on the device): the same
    greedy tokens as sync scheduling on the same device, up to a near-tie (arrivals are admitted
    a step later under async scheduling, so batches are made up differently)."""
    refm, prompts = reference
    requests = _requests(prompts)
    sync, sync_log, _, _ = _run(tiny_model_dir, requests, num_kv_blocks=64, async_scheduling=False)
    ahead, ahead_log, _, _ = _run(tiny_model_dir, requests, num_kv_blocks=64, async_scheduling=True)
    assert sync_log.num_mixed > 0 and ahead_log.num_mixed > 0 and ahead_log.mixed_ahead > 0
    for rid, p, _ in requests:
        assert_same_greedy(refm, p, ahead[rid], sync[rid], f"request {rid}")
