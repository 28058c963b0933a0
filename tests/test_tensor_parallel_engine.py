"""Tensor parallelism through the engine on the numpy backend: EngineConfig.tensor_parallel_size,
`--tensor-parallel-size` on every engine command, LLM(tensor_parallel_size=N), greedy generation
over two ranks equal to one rank token for token, each rank's share in memory_report() and
`inspect`, and every bad N one ConfigError line."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinyvllm.cli import build_parser, engine_options_from_args, main
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import SamplingBatch
from tinyvllm.engine.llm import LLM
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import ConfigError
from tinyvllm.parallel.numpy_ranks import ShardedNumpyRunner
from tinyvllm.parallel.sharding import check_engine_split

CPU = dict(device="cpu", num_kv_blocks=64, max_model_len=256, block_size=4)


def run_outputs(engine: LLMEngine, prompts, params: SamplingParams) -> list:
    """Each prompt's first sample (a CompletionOutput), all prompts stepped together."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)].outputs[0] for i in range(len(prompts))]


def run(engine: LLMEngine, prompts, params: SamplingParams) -> list[list[int]]:
    return [list(out.token_ids) for out in run_outputs(engine, prompts, params)]


def test_greedy_generation_over_two_ranks_equals_one_rank(tiny_model_dir):
    """Prompts of several lengths, continuous batching with prefill and decode steps mixed: the
    same tokens from one rank and from two (the reduced argmax, no logits gathered)."""
    prompts = ["The capital of France is", "1 2 3 4 5 6 7 8", "Once upon a time, in a land far", "a"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLMEngine(tiny_model_dir, **CPU)
    two = LLMEngine(tiny_model_dir, tensor_parallel_size=2, **CPU)
    ahead = LLMEngine(tiny_model_dir, tensor_parallel_size=2, async_scheduling=True, **CPU)   # fed ids
    assert isinstance(two.runner, ShardedNumpyRunner) and not isinstance(one.runner, ShardedNumpyRunner)
    assert two.runner.num_kv_blocks == one.runner.num_kv_blocks
    want = run(one, prompts, params)
    assert run(two, prompts, params) == want
    assert run(ahead, prompts, params) == want
    assert all(len(t) == 12 for t in want) and len({tuple(t) for t in want}) > 1
    for engine in (one, two, ahead):
        engine.close()


def test_sampling_steps_gather_the_logits_and_give_logprobs(tiny_model_dir):
    """A step with temperature and logprobs gathers its rows' logits: the same draws (the
    sampler is exact integer arithmetic over the same weights) and logprobs within fp32 rounding."""
    llm_one = LLM(tiny_model_dir, **CPU)
    llm_two = LLM(tiny_model_dir, tensor_parallel_size=2, **CPU)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, logprobs=2, ignore_eos=True)
    a = llm_one.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]
    b = llm_two.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        np.testing.assert_allclose([v.logprob for v in y.values()], [v.logprob for v in x.values()], atol=1e-4)


def test_memory_report_shows_each_ranks_share(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, tensor_parallel_size=4, **CPU)
    report = engine.runner.memory_report()
    config = ModelConfig.from_pretrained(tiny_model_dir)
    for rank in range(4):
        assert f"rank {rank}: q heads {rank}, kv heads {rank // 2}," in report
        assert f"rank {rank}: holds weights" in report
    kv = engine.runner.kv_caches[0]
    assert kv.shape[4] == 1 and kv.nbytes == engine.runner.num_kv_blocks * 4 * config.num_hidden_layers * 2 * 64 * 4
    engine.close()


@pytest.mark.parametrize("size,says", [
    (0, "tensor_parallel_size must be an integer in \\[1, "), (-1, "tensor_parallel_size must be an integer in"),
    (3, "tensor_parallel_size=3 does not divide num_attention_heads=4")])
def test_bad_sizes_are_one_config_error_line(tiny_model_dir, size, says):
    with pytest.raises(ConfigError, match=says) as e:
        LLMEngine(tiny_model_dir, tensor_parallel_size=size, **CPU)
    assert "\n" not in str(e.value)


def test_cuda_refuses_more_ranks_than_gpus_and_shapes_it_cannot_split():
    config = ModelConfig.from_dict(dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        rms_norm_eps=1e-5, max_position_embeddings=64, vocab_size=100))
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 but 2 GPUs are visible"):
        check_engine_split(config, EngineConfig(tensor_parallel_size=4), visible_gpus=lambda: 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 but 1 GPU is visible"):
        check_engine_split(config, EngineConfig(tensor_parallel_size=2), visible_gpus=lambda: 1)
    check_engine_split(config, EngineConfig(tensor_parallel_size=2), visible_gpus=lambda: 2)    # gpu/tp_layer.py
    odd = dataclasses.replace(config, hidden_size=72, head_dim=18)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 on cuda needs hidden_size % 16 == 0"):
        check_engine_split(odd, EngineConfig(tensor_parallel_size=2), visible_gpus=lambda: 2)
    check_engine_split(odd, EngineConfig(tensor_parallel_size=2, device="cpu"))       # the numpy ranks can
    uneven = dataclasses.replace(config, intermediate_size=130)
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 on cuda needs it to divide intermediate_size=130"):
        check_engine_split(uneven, EngineConfig(tensor_parallel_size=4), visible_gpus=lambda: 4)
    check_engine_split(uneven, EngineConfig(tensor_parallel_size=4, device="cpu"))    # balanced shards there
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs unquantized weights; --quantization fp8"):
        check_engine_split(config, EngineConfig(tensor_parallel_size=2, quantization="fp8"), visible_gpus=lambda: 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=1 but 0 GPUs are visible"):
        check_engine_split(config, EngineConfig(tensor_parallel_size=1), visible_gpus=lambda: 0)
    check_engine_split(config, EngineConfig(tensor_parallel_size=1), visible_gpus=lambda: 1)  # one rank, in process
    with pytest.raises(ConfigError, match="trace without --tensor-parallel-size"):
        check_engine_split(config, EngineConfig(tensor_parallel_size=1, trace_steps=2), visible_gpus=lambda: 1)
    with pytest.raises(ConfigError, match="trace without --tensor-parallel-size"):
        check_engine_split(config, EngineConfig(tensor_parallel_size=2, trace_steps=2, device="cpu"))
    check_engine_split(config, EngineConfig(tensor_parallel_size=1, trace_steps=2, device="cpu"))
    check_engine_split(config, EngineConfig(), visible_gpus=lambda: 0)          # None: the in-process runner


@pytest.mark.parametrize("command", [["generate", "--model", "m", "x"], ["serve", "--model", "m"], ["bench"]])
def test_tensor_parallel_flag_on_every_engine_command(command):
    parse = lambda *flags: engine_options_from_args(build_parser().parse_args([*command, *flags]))  # noqa: E731
    assert "tensor_parallel_size" not in parse()
    assert parse("--tensor-parallel-size", "2")["tensor_parallel_size"] == 2


def test_generate_cli_over_two_ranks_and_a_bad_n(tiny_model_dir, capsys):
    args = ["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--num-kv-blocks", "64",
            "--max-model-len", "256", "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "Hi"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main([*args, "--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == one
    assert main([*args, "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "tinyvllm: error: tensor_parallel_size=3 does not divide num_attention_heads=4" in err
    assert "Traceback" not in err


def test_inspect_shows_each_ranks_share(tiny_model_dir, capsys):
    assert main(["inspect", "--model", str(tiny_model_dir), "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    config = ModelConfig.from_pretrained(tiny_model_dir)
    half = config.vocab_size // 2
    assert f"rank 0: q heads 0-1, kv heads 0, intermediate 0-383, vocab 0-{half - 1};" in out
    assert f"rank 1: q heads 2-3, kv heads 1, intermediate 384-767, vocab {half}-{config.vocab_size - 1};" in out
    assert "rank 2" not in out
    main(["inspect", "--model", str(tiny_model_dir)])
    assert "tensor parallel" not in capsys.readouterr().out


def rank_processes(tiny_model_dir, **options):
    """A one-rank group on the numpy backend: rank 0 in this process, no rank process (on cuda
    the same class holds a CudaRunner and a one-rank NCCL communicator)."""
    from tinyvllm.parallel.workers import RankProcesses
    config = ModelConfig.from_pretrained(tiny_model_dir)
    engine_config = EngineConfig(tensor_parallel_size=1, **dict(CPU, **options))
    return RankProcesses(config, engine_config, tiny_model_dir, None)


def test_a_one_rank_group_gives_the_in_process_runners_tokens_and_logprobs(tiny_model_dir):
    """Steps launched ahead (async scheduling: fed ids) and sampled with logprobs through the
    group's runner: the very bits of the numpy runner on its own."""
    prompts = ["The capital of France is", "1 2 3 4 5", "a"]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=5, logprobs=3, ignore_eos=True)
    for options in ({}, {"async_scheduling": True}):
        here = LLMEngine(tiny_model_dir, **dict(CPU, **options))
        there = LLMEngine(tiny_model_dir, runner=rank_processes(tiny_model_dir), **dict(CPU, **options))
        try:
            assert run(there, prompts, plain) == run(here, prompts, plain)
            assert run(there, prompts[:1], sampled) == run(here, prompts[:1], sampled)
            assert there.runner.last_logprobs is not None
            np.testing.assert_array_equal(there.runner.last_logprobs.top_ids, here.runner.last_logprobs.top_ids)
            assert there.runner.num_kv_blocks == here.runner.num_kv_blocks
            np.testing.assert_array_equal(there.runner.prompt_logits([1, 2, 3]), here.runner.prompt_logits([1, 2, 3]))
        finally:
            here.close()
            there.close()
        assert not there.runner.processes


def test_a_rank_process_that_cannot_start_raises_its_error_here(tmp_path):
    from tinyvllm.errors import ModelLoadError
    from tinyvllm.parallel.workers import RankProcesses
    config = ModelConfig.from_dict(dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        rms_norm_eps=1e-5, max_position_embeddings=64, vocab_size=100))
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        RankProcesses(config, EngineConfig(tensor_parallel_size=1, **CPU), tmp_path, None)


def test_rank_zero_runs_in_the_engine_process_and_raises_its_own_errors(tiny_model_dir):
    """One rank: no process at all, the in-process runner itself; its errors are its own."""
    from tinyvllm.engine.batch import ForwardBatch
    from tinyvllm.reference.numpy_runner import NumpyRunner
    runner = rank_processes(tiny_model_dir)
    try:
        assert not runner.processes and isinstance(runner.local, NumpyRunner)
        batch = ForwardBatch.build_decode([0], [3], np.zeros((1, 1), np.int32), 4)
        batch.fed_rows = np.zeros(1, np.int32)         # fed ids, but no step launched before it
        greedy = SamplingBatch.build([0], [0], [1], [0], [0])
        with pytest.raises(ValueError, match="a step with fed tokens needs a step"):
            runner.launch(batch, greedy).wait()
    finally:
        runner.close()
