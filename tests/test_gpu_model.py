"""The whole forward pass on the GPU (CudaRunner + LlamaModel) against the numpy reference on the
tiny preset: a prefill of prompts of different lengths, then 32 decode steps over shuffled block
tables, compared every step.

What "correct" means for a bf16 engine: every kernel matches its fp32 twin to ~2e-3
(test_gpu_kernels), but through the layers bf16 rounding noise grows (the tiny preset's sharp
attention amplifies it), so logits of ANY bf16 implementation differ from the exact fp32 result
by 1-3e-2. The test therefore measures three per-step relative errors:
    gpu vs fp32            the GPU's distance to the exact answer
    bf16-numpy vs fp32     the same distance for numpy rounding to bf16 exactly where the GPU
                           stores bf16 (ReferenceModel(round_bf16=True))
    gpu vs bf16-numpy      printed for information
and asserts that the GPU is no further from the exact answer than the bf16 numpy twin
(mean over the steps, ratio <= BF16_NOISE_RATIO), and no step further than STEP_NOISE_RATIO times the
twin's worst step (bf16 noise fluctuates from step to step; a broken step is O(1) off). Greedy tokens must agree
with the reference except where its top two logits are closer than twice that row's largest
logit error (a near-tie the rounding can flip); such cases are counted and printed.
"""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.reference.model import ReferenceModel

pytestmark = pytest.mark.gpu
BF16_NOISE_RATIO = 1.5     # mean over steps of gpu-vs-fp32 / bf16numpy-vs-fp32 error
STEP_NOISE_RATIO = 2.0     # any step's gpu-vs-fp32 error / the twin's largest over the steps
BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from tinyvllm.gpu.cuda_runner import CudaRunner
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_weights(tiny_model_dir, cfg)
    runner = CudaRunner(cfg, weights, EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                                    num_kv_blocks=128, block_size=BLOCK, max_model_len=2048))
    yield cfg, runner, ReferenceModel(cfg, weights, round_bf16=True), ReferenceModel(cfg, weights)
    runner.close()


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
def test_tiny_model_matches_reference(tiny, fused_decode):
    """The decode steps (eager here, through forward_logits) on the fused layer (the default: five
    launches, each norm handed over, gpu/model.py) and on the nine-launch layer
    (EngineConfig.fused_decode=False), both held to the numpy reference with the same tolerances."""
    from gpu_helpers import decode_layer, logits_match_reference
    cfg, runner, refm, ref32 = tiny
    with decode_layer(runner, fused_decode):
        logits_match_reference(cfg, runner, refm, ref32, BLOCK, BF16_NOISE_RATIO, STEP_NOISE_RATIO)


def test_execute_samples_greedy_argmax(tiny):
    """execute() = forward + the GPU sampler: greedy ids equal the argmax of forward_logits."""
    cfg, runner, _, _ = tiny
    rng = np.random.default_rng()
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (9, 40)]
    tables = [[0, 1, 2], [3, 4, 5, 6]]
    batch = ForwardBatch.build(prompts, [9, 40], tables, BLOCK, is_prefill=True)
    logits = runner.forward_logits(batch)
    ids = runner.execute(batch, SamplingBatch.greedy(2))
    np.testing.assert_array_equal(ids, logits.argmax(-1))


def test_llama_1b_prefill_and_decode(tmp_path_factory):
    """The Llama-3.2-1B-shaped preset runs a 128-token prefill and decode steps with finite,
    varied logits."""
    import time

    from tinyvllm.checkpoint.model_writer import write_model
    from tinyvllm.gpu.cuda_runner import CudaRunner
    path = write_model(tmp_path_factory.mktemp("llama-1b"), preset="llama-3.2-1b", seed=0)
    cfg = ModelConfig.from_pretrained(path)
    runner = CudaRunner(cfg, load_weights(path, cfg), EngineConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                                                   kv_cache_gb=1.0, max_model_len=4096))
    try:
        rng = np.random.default_rng()
        prompt = list(rng.integers(0, cfg.vocab_size, 128))
        table = [list(range(16))]
        batch = ForwardBatch.build([prompt], [128], table, BLOCK, is_prefill=True)
        logits = runner.forward_logits(batch)
        assert np.isfinite(logits).all() and logits.std() > 0.1
        token, ctx, times = int(logits.argmax()), 128, []
        for _ in range(16):
            ctx += 1
            batch = ForwardBatch.build([[token]], [ctx], table, BLOCK, is_prefill=False)
            t0 = time.perf_counter()
            token = int(runner.execute(batch, SamplingBatch.greedy(1))[0])
            times.append(time.perf_counter() - t0)
        print(f"1B eager decode step (batch 1, context ~140): median {np.median(times) * 1e3:.2f} ms")
        logits = runner.forward_logits(batch)
        assert np.isfinite(logits).all() and logits.std() > 0.1
    finally:
        runner.close()


def test_graph_replay_equals_eager(tiny):
    """Decode steps replayed from the captured graphs (captured on dummy inputs) give exactly the
    logits and tokens of the same launches run eagerly on the real inputs: bitwise equal."""
    cfg, runner, _, _ = tiny
    assert runner.graphs, "the tiny runner captures decode graphs (enforce_eager is off)"
    rng = np.random.default_rng()
    lens = [7, 30, 18]                      # 3 sequences: replayed on the size-4 graph, padded
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in lens]
    tables = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    batch = ForwardBatch.build(prompts, lens, tables, BLOCK, is_prefill=True)
    tokens = runner.execute(batch, SamplingBatch.greedy(3))
    ctx = list(lens)
    sampling = SamplingBatch.build([0.0, 0.8, 1.0], [-1, 50, -1], [1.0, 1.0, 0.9], [1, 2, 3], [0, 0, 0])
    for step in range(16):
        ctx = [c + 1 for c in ctx]
        batch = ForwardBatch.build([[int(t)] for t in tokens], ctx, tables, BLOCK, is_prefill=False)
        eager_ids = runner.execute(batch, sampling, replay=False)
        eager_logits = runner.read_logits(1)        # the greedy row is not overwritten by sampling
        graph_ids = runner.execute(batch, sampling)
        graph_logits = runner.read_logits(1)
        np.testing.assert_array_equal(graph_ids, eager_ids)
        np.testing.assert_array_equal(graph_logits, eager_logits)
        tokens = graph_ids
        sampling.step += 1


def _decode_run(cfg, runner, rng_seed: int, steps: int = 12, num_seqs: int = 3, replay: bool = True):
    """Prefill up to 3 prompts, then greedy decode through the graphs (replay=False: the same
    launches eagerly); -> per-step logits."""
    rng = np.random.default_rng(rng_seed)
    lens = [9, 33, 20][:num_seqs]
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in lens]
    tables = [[40, 41, 42, 43], [50, 51, 52, 53], [60, 61, 62, 63]][:num_seqs]
    tokens = runner.execute(ForwardBatch.build(prompts, lens, tables, BLOCK, is_prefill=True),
                            SamplingBatch.greedy(num_seqs))
    ctx, out = list(lens), []
    for _ in range(steps):
        ctx = [c + 1 for c in ctx]
        tokens = runner.execute(ForwardBatch.build([[int(t)] for t in tokens], ctx, tables, BLOCK, False),
                                SamplingBatch.greedy(num_seqs), replay=replay)
        out.append(runner.read_logits(num_seqs))
    return out


def _assert_steps_equal(a_steps, b_steps) -> None:
    for step, (a, b) in enumerate(zip(a_steps, b_steps, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"decode step {step}")


def _assert_settings_give_the_same_steps(tiny, rng_seed: int, num_seqs: int, a: dict, b: dict) -> None:
    """24 decode steps through graphs captured with GpuOps settings a, then b: bitwise equal logits."""
    cfg, runner, _, _ = tiny
    runs = []
    for settings in (a, b):
        with runner.recaptured(**settings):
            runs.append(_decode_run(cfg, runner, rng_seed, steps=24, num_seqs=num_seqs))
    _assert_steps_equal(*runs)


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
def test_pdl_graphs_equal_plain_graphs(tiny, fused_decode):
    """Programmatic dependent launch only lets a kernel start early and wait (gpu/kernels.py):
    the graphs captured with it give bitwise the logits of graphs captured without it
    (EngineConfig.pdl=False), on either decode layer."""
    cfg, runner, _, _ = tiny
    assert runner.ops.pdl and runner.ops.fused_decode, "EngineConfig's defaults"
    with runner.recaptured(fused_decode=fused_decode):
        with_pdl = _decode_run(cfg, runner, 7)
    with runner.recaptured(fused_decode=fused_decode, pdl=False):
        without = _decode_run(cfg, runner, 7)
    _assert_steps_equal(with_pdl, without)


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_graphs_under_pdl_equal_eager_steps_without_it(tiny, num_seqs, fused_decode):
    """The decode graphs under PDL, where kernels overlap their neighbours — the decode attention's
    early K/V copies go out while the qkv GEMV that writes the newest row still runs, the fused
    layer's `normed` and row sums are read by the next GEMV and rewritten two kernels later —
    give bitwise the logits of the same launches run eagerly, one at a time without PDL."""
    cfg, runner, _, _ = tiny
    with runner.recaptured(fused_decode=fused_decode):
        graphs = _decode_run(cfg, runner, 29, steps=24, num_seqs=num_seqs)
        runner.ops.pdl = False
        try:
            eager = _decode_run(cfg, runner, 29, steps=24, num_seqs=num_seqs, replay=False)
        finally:
            runner.ops.pdl = True
    _assert_steps_equal(graphs, eager)


def test_steps_upload_into_the_input_banks_in_turn(tiny):
    """cuda_runner's module docstring: each staged step takes the next input bank, its inputs
    go up there (on the copy stream) and the other bank keeps the step before's. Read back from
    the device after two steps of different contexts, each bank holds its own step's inputs."""
    import pycuda.driver as drv
    _, runner, _, _ = tiny
    steps, batches = [], []
    with runner.device.active():
        for ctx in ([17, 40], [23, 5]):
            batch = ForwardBatch.build([[3], [4]], ctx, [[7, 8, 9], [10, 11, 12]], BLOCK, is_prefill=False)
            steps.append(runner._stage_inputs(batch, SamplingBatch.greedy(2)))
            batches.append(batch)
        runner.stream.synchronize()
        assert {s.bank for s in steps} == {0, 1}, "two steps in a row take both banks"
        for step, batch in zip(steps, batches):
            got = np.empty(2, np.int32)
            drv.memcpy_dtoh(got, int(runner.arena.view("context_lens", step.bank)))
            np.testing.assert_array_equal(got, batch.context_lens)
            drv.memcpy_dtoh(got, int(runner.arena.view("decode_positions", step.bank)))
            np.testing.assert_array_equal(got, batch.positions)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_each_banks_graph_gives_the_eager_steps(tiny, num_seqs):
    """A decode size has one graph per input bank, and consecutive steps alternate them: 24
    steps through the graphs (12 on each bank, each reading and bringing down its own bank's
    inputs and ids) give bitwise the logits and ids of the same launches run eagerly."""
    cfg, runner, _, _ = tiny
    size = runner._graph_size_for(num_seqs)
    assert {bank for s, bank in runner.graphs if s == size} == {0, 1}
    banks = []
    stage = runner._stage_inputs
    def recording_stage(*args, **kwargs):
        step = stage(*args, **kwargs)
        banks.append(step.bank)
        return step
    runner._stage_inputs = recording_stage
    try:
        graphs = _decode_run(cfg, runner, 31, steps=24, num_seqs=num_seqs)
    finally:
        del runner._stage_inputs
    eager = _decode_run(cfg, runner, 31, steps=24, num_seqs=num_seqs, replay=False)
    assert banks[1:] == [1 - b for b in banks[:-1]], "the steps alternate the banks"
    _assert_steps_equal(graphs, eager)


def _ops_of_a_decode_step(cfg, runner, num_seqs: int) -> list[str]:
    """The ops one eager decode step of num_seqs sequences launches (after their prefill)."""
    calls, tables = [], [[70 + i] for i in range(num_seqs)]
    tokens = runner.execute(ForwardBatch.build([[1, 2, 3, 4]] * num_seqs, [4] * num_seqs, tables, BLOCK, True),
                            SamplingBatch.greedy(num_seqs))
    runner.ops.observer = lambda op, repeat, details: calls.append(op)
    try:
        runner.execute(ForwardBatch.build([[int(t)] for t in tokens], [5] * num_seqs, tables, BLOCK, False),
                       SamplingBatch.greedy(num_seqs), replay=False)
    finally:
        runner.ops.observer = None
    return calls


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_decode_layer_launches(tiny, num_seqs):
    """A decode step on the fused layer: per layer the prenormed qkv + RoPE and gate_up + silu
    GEMVs and two residual GEMVs handing the norms over, no rms_norm, rope_write_kv or silu_mul;
    the LM head prenormed. With ops.fused_decode cleared: the nine launches per layer and the
    final rms_norm, none of the fused kernels."""
    cfg, runner, _, _ = tiny
    L = cfg.num_hidden_layers
    calls = _ops_of_a_decode_step(cfg, runner, num_seqs)
    assert calls.count("gemv_prenormed_rope_kv_bf16") == L and calls.count("gemv_prenormed_silu_mul_bf16") == L
    assert calls.count("gemv_residual_norm_bf16") == 2 * L and calls.count("gemv_prenormed_bf16") == 1
    assert not {"rms_norm", "rope_write_kv", "silu_mul"} & set(calls), calls
    with runner.recaptured(fused_decode=False):
        calls = _ops_of_a_decode_step(cfg, runner, num_seqs)
    assert calls.count("rms_norm") == 2 * L + 1 and calls.count("rope_write_kv") == L and calls.count("silu_mul") == L
    assert not any(op.startswith("gemv_") for op in calls), calls   # linear()'s "gemv NxK" only


def test_engine_config_switches_reach_the_launchers(tiny, tiny_model_dir):
    """EngineConfig(fused_decode=False, pdl=False) (--no-fused-decode --no-pdl) builds a runner
    whose launchers have both off: its eager decode steps give bitwise the logits of the default
    runner's graphs captured with ops.fused_decode and ops.pdl cleared."""
    from tinyvllm.gpu.cuda_runner import CudaRunner
    cfg, runner, _, _ = tiny
    other = CudaRunner(cfg, load_weights(tiny_model_dir, cfg),
                       EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, num_kv_blocks=128, block_size=BLOCK,
                                    max_model_len=2048, fused_decode=False, pdl=False, enforce_eager=True))
    try:
        assert other.ops.fused_decode is False and other.ops.pdl is False and not other.graphs
        switched_off = _decode_run(cfg, other, 37, num_seqs=2)     # a graph size: no padding
    finally:
        other.close()
    with runner.recaptured(fused_decode=False, pdl=False):
        default_runner = _decode_run(cfg, runner, 37, num_seqs=2)
    _assert_steps_equal(switched_off, default_runner)
