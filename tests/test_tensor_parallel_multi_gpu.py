"""Tensor parallelism over several GPUs (marker gpu; each test skips, saying why, where fewer GPUs
than it splits over are visible or NCCL is missing): `tensor_parallel_size` 2 (and 4 where 4 GPUs
are visible) through the group's ranks (parallel/workers.py: rank 0 in the engine process, the
others in rank processes; parallel/cuda_rank.py) and the
sharded forward (gpu/tp_layer.py) against one GPU's default in-process path.

Sharding changes the order of the o and down sums (each rank's partial product rounded to bf16,
then summed by NCCL in bf16) and of nothing else, so greedy tokens must equal one GPU's up to the
bf16 near-ties of tests/test_gpu_engine.py's rule (at the first difference the fp32 reference's
logits of the two tokens within NEAR_TIE), and the teacher-forced logits must stay within the bf16
noise of the numpy twin (gpu_helpers.logits_match_reference), on the fused decode layer and the
nine-launch one. Every rank holds the same logits bit for bit (the gathered slices), so every rank
samples the same ids.

Run on a machine with 2+ GPUs: NCCL_NVLS_ENABLE=0 python -m pytest -m gpu tests/test_tensor_parallel_multi_gpu.py
"""
from __future__ import annotations

import numpy as np
import pytest
from test_gpu_engine import NEAR_TIE, assert_same_greedy

from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.engine.llm import LLM
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import ConfigError, GPUUnavailableError
from tinyvllm.reference.model import ReferenceModel

pytestmark = pytest.mark.gpu
OPTIONS = dict(device="cuda", kv_cache_gb=0.5, max_model_len=1024, max_num_seqs=16, block_size=16)
MAX_TOKENS = 24
BLOCK = 16
# gpu_helpers.logits_match_reference's bounds, as tests/test_gpu_model.py holds one GPU to them,
# except the noise ratio: each residual add over N ranks rounds to bf16 N + (N - 1) + 1 times
# (each rank's product, NCCL's adds, the add into the residual) where one GPU rounds once
TP_NOISE_RATIO = 2.0
STEP_NOISE_RATIO = 2.0 * TP_NOISE_RATIO / 1.5   # one GPU's 2.0, scaled as its mean ratio 1.5 is


@pytest.fixture(scope="module")
def gpus() -> int:
    from tinyvllm.gpu.nccl import load_libnccl
    from tinyvllm.parallel.sharding import visible_gpu_count
    count = visible_gpu_count()
    if count < 2:
        pytest.skip(f"tensor parallelism over GPUs needs at least 2 visible GPUs, {count} visible")
    try:
        load_libnccl()
    except GPUUnavailableError as e:
        pytest.skip(str(e))
    return count


def need(gpus: int, size: int) -> None:
    if gpus < size:
        pytest.skip(f"tensor_parallel_size={size} needs {size} GPUs, {gpus} visible")


@pytest.fixture(scope="module")
def llama_1b_dir(tmp_path_factory):
    """The llama-3.2-1b preset with random weights (2.5 GB), written once for the module."""
    from tinyvllm.checkpoint.model_writer import write_model
    return write_model(tmp_path_factory.mktemp("llama-1b"), preset="llama-3.2-1b", seed=0)


def _setup(model_dir):
    cfg = ModelConfig.from_pretrained(model_dir)
    rng = np.random.default_rng()
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (3, 17, 40, 9, 64, 100, 5, 33, 70, 12)]
    return cfg, prompts


def _generate(model_dir, prompts, params, **options):
    llm = LLM(model_dir, **{**OPTIONS, **options})
    try:
        outputs = [llm.generate([{"prompt_token_ids": p} for p in group], params) for group in (prompts[:4], prompts)]
        report = llm.engine.runner.memory_report()
    finally:
        llm.engine.close()
    return [o.outputs[0] for group in outputs for o in group], report


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b"])
@pytest.mark.parametrize("size", [2, 4])
def test_greedy_over_ranks_equals_one_gpu(gpus, preset, size, tiny_model_dir, request):
    """Four prompts (decode steps of at most 8 rows: the fused layer) then ten (the nine-launch
    layer above 8), greedy, through the decode graphs; every rank captured them."""
    need(gpus, size)
    model_dir = tiny_model_dir if preset == "tiny" else request.getfixturevalue("llama_1b_dir")
    cfg, prompts = _setup(model_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want, _ = _generate(model_dir, prompts, params)
    got, report = _generate(model_dir, prompts, params, tensor_parallel_size=size)
    assert report.count("decode graphs captured for batch sizes [") == size, report
    refm = ReferenceModel(cfg, load_weights(model_dir, cfg))
    diverged = [assert_same_greedy(refm, p, g.token_ids, w.token_ids, f"prompt {i}")
                for i, (p, g, w) in enumerate(zip(prompts[:4] + prompts, got, want))]
    print(f"{preset} over {size} ranks: near-tie divergences {sum(d is not None for d in diverged)} of {len(got)}")


class RankZeroLogits:
    """forward_logits over a rank group: every rank's gathered logits, which must be the same
    bits on every rank; rank 0's returned (gpu_helpers.logits_match_reference's runner)."""

    def __init__(self, ranks):
        self.ranks, self.num_kv_blocks = ranks, ranks.num_kv_blocks

    def forward_logits(self, batch) -> np.ndarray:
        per_rank = self.ranks._call("forward_logits", batch)
        for rank, logits in enumerate(per_rank[1:], 1):
            np.testing.assert_array_equal(logits.view(np.uint32), per_rank[0].view(np.uint32), f"rank {rank}")
        return per_rank[0]


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
@pytest.mark.parametrize("size", [2, 4])
def test_logits_over_ranks_match_the_reference(gpus, size, fused_decode, tiny_model_dir):
    """A prefill and 32 teacher-forced decode steps (eager: forward_logits on every rank), held
    to the numpy twin as one GPU is (tests/test_gpu_model.py), every rank's logits the same bits."""
    from gpu_helpers import logits_match_reference
    need(gpus, size)
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_weights(tiny_model_dir, cfg)
    engine = LLMEngine(tiny_model_dir, tensor_parallel_size=size, fused_decode=fused_decode, **OPTIONS)
    try:
        logits_match_reference(cfg, RankZeroLogits(engine.runner), ReferenceModel(cfg, weights, round_bf16=True),
                               ReferenceModel(cfg, weights), BLOCK, TP_NOISE_RATIO, STEP_NOISE_RATIO)
    finally:
        engine.close()


def test_seeded_sampling_and_logprobs_over_ranks(gpus, tiny_model_dir):
    """Seeded sampling with top-p and logprobs over 2 ranks gives the same tokens and logprobs
    every run (every rank samples the same gathered logits), and one GPU's tokens and logprobs up
    to the first difference, each logprob within NEAR_TIE (about twice the largest logit error)."""
    need(gpus, 2)
    _, prompts = _setup(tiny_model_dir)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=12, logprobs=2, ignore_eos=True)
    runs = [_generate(tiny_model_dir, prompts[:4], params, tensor_parallel_size=2)[0] for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [o.logprobs for o in runs[0]] == [o.logprobs for o in runs[1]]
    want, _ = _generate(tiny_model_dir, prompts[:4], params)
    compared = 0
    for g, w in zip(runs[0], want):
        for j, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if a != b:
                break
            lp_g, lp_w = g.logprobs[j][a], w.logprobs[j][b]
            assert abs(lp_g.logprob - lp_w.logprob) < NEAR_TIE, (j, lp_g, lp_w)
            compared += 1
    assert compared > 0
    print(f"sampled tokens compared with one GPU's: {compared} of {sum(len(o.token_ids) for o in want)}")


def test_decode_graphs_over_ranks_give_the_eager_tokens(gpus, tiny_model_dir):
    """The same steps replayed from the ranks' captured decode graphs (NCCL's collectives inside)
    and run eagerly (enforce_eager): greedy tokens equal up to the near-tie rule."""
    need(gpus, 2)
    cfg, prompts = _setup(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    graphs, with_graphs = _generate(tiny_model_dir, prompts, params, tensor_parallel_size=2)
    eager, without = _generate(tiny_model_dir, prompts, params, tensor_parallel_size=2, enforce_eager=True)
    assert with_graphs.count("decode graphs captured for batch sizes [") == 2
    assert without.count("none (eager)") == 2
    refm = ReferenceModel(cfg, load_weights(tiny_model_dir, cfg))
    for i, (p, g, e) in enumerate(zip(prompts[:4] + prompts, graphs, eager)):
        assert_same_greedy(refm, p, g.token_ids, e.token_ids, f"prompt {i}")


def test_more_ranks_than_visible_gpus_is_one_config_error(gpus, tiny_model_dir):
    if gpus >= 4:
        pytest.skip(f"the tiny preset splits over at most 4 ranks, and {gpus} GPUs are visible")
    with pytest.raises(ConfigError, match=f"tensor_parallel_size=4 but {gpus} GPUs are visible") as e:
        LLMEngine(tiny_model_dir, tensor_parallel_size=4, **OPTIONS)
    assert "\n" not in str(e.value)
