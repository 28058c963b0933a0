"""The CUDA forward of a tensor-parallel rank (gpu/tp_layer.py), checked on the CPU: the real
LlamaModel.forward and GpuOps launchers of every rank of a 2- and 4-rank split, over
test_family_launches.py's checked kernel library (each launch against its kernel's C signature,
block size and shared memory) and a communicator that records the collectives. Every rank must
enqueue the same collectives with the same counts in the same order (NCCL matches them by
order), the products must be summed before the residual add (no single-GPU residual GEMV, no
gather that hands a norm over from partial rows), and the step must end with the LM head's keys
maxed (fused decode) and the logits gathered (every slice broadcast, then placed)."""
from __future__ import annotations

import pytest
from test_family_launches import _configs, _fake

from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.errors import ConfigError
from tinyvllm.gpu.step_shape import StepShape
from tinyvllm.gpu.tp_layer import TensorParallelRank
from tinyvllm.parallel.sharding import rank_config, rank_shards

SINGLE_GPU_ONLY = ("gemv_residual_norm_bf16", "embedding_gather", "embedding_gather_scaled")


class _Recorder:
    """An NcclCommunicator that records each collective into the launch list, in order."""

    def __init__(self, launched: list):
        self.launched = launched

    def all_reduce(self, send, recv, count, dtype, stream, op="sum"):
        assert send == recv, "the collectives run in place"
        self.launched.append(f"nccl all_reduce {op} {count} x {dtype}")

    def broadcast_each(self, parts, dtype, stream):
        self.launched.append(f"nccl broadcast_each {[count for _, count in parts]} x {dtype}")


def _ranks(family: str, size: int, fused_decode: bool):
    config = _configs()[family]
    try:
        shards = rank_shards(config, size)
    except ConfigError as e:
        pytest.skip(str(e))
    fakes = []
    for shard in shards:
        fake = _fake(rank_config(config, shard), fused_decode)
        fake.model.tp = TensorParallelRank(_Recorder(fake.ops.library.launched), shard.rank, [s.vocab for s in shards],
                                       config.vocab_size, stream=type("Stream", (), {"handle": 0})(),
                                       parts=[0x7C0000000000 + (1 << 30) * r for r in range(size)])
        fakes.append(fake)
    return config, fakes


def _step(fake, batch: ForwardBatch) -> list[str]:
    fake.ops.library.launched.clear()
    fake.model.forward(StepShape(batch.num_tokens, batch.num_seqs, batch.is_prefill,
                                 int(max(batch.query_start[1:] - batch.query_start[:-1]))))
    return list(fake.ops.library.launched)


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral", "qwen2", "qwen3"])
def test_every_rank_enqueues_the_same_collectives(family, size, fused_decode):
    config, fakes = _ranks(family, size, fused_decode)
    L = config.num_hidden_layers
    prompt = ForwardBatch.build([list(range(1, 12)), [3, 4]], [11, 30], [[5], [6, 7]], 16, is_prefill=True)
    steps = [(prompt, 13, False)] + [(ForwardBatch.build([[7]] * s, [12] * s, [[5]] * s, 16, is_prefill=False), s,
                                      fused_decode) for s in (1, 3)]
    for batch, rows, fused in steps:
        launched = [_step(fake, batch) for fake in fakes]
        collectives = [[op for op in ops if op.startswith("nccl")] for ops in launched]
        assert all(c == collectives[0] for c in collectives[1:]), collectives
        H, S = config.hidden_size, batch.num_seqs
        sums = [f"nccl all_reduce sum {rows * H} x bfloat16"] * (1 + 2 * L)
        keys = [f"nccl all_reduce max {S} x uint64"] if fused else []
        tail = keys + [f"nccl broadcast_each {[S * len(s) for s in fakes[0].model.tp.vocab_slices]} x float32",
                       *["place_vocab_slice"] * size]
        assert collectives[0] == sums + tail[:len(tail) - size]
        for rank, ops in enumerate(launched):
            assert not set(ops) & set(SINGLE_GPU_ONLY), ops
            assert ops[0] == "embedding_gather_shard" and ops[1] == "nccl all_reduce sum " + f"{rows * H} x bfloat16"
            # each o / down product summed, then added into the residual (Gemma 3: normalised first)
            add = "rms_norm_residual_add" if config.sandwich_norms else "residual_add"
            sums_at = [i for i, op in enumerate(ops) if op.startswith("nccl all_reduce sum")]
            assert [ops[i + 1] for i in sums_at[1:]] == [add] * (2 * L)
            assert ops.count("residual_add") == 2 * L * (not config.sandwich_norms) + fused
            assert ops.count("shift_argmax_keys") == int(fused and rank > 0)
            if fused:   # the first layer's norm handed over after the embedding's sum; the head, its keys, the gather
                assert ops[2] == "residual_add"
                head = len(ops) - 1 - ops[::-1].index("gemv_prenormed_bf16")
                assert ops[head + 1:] == ["shift_argmax_keys"] * (rank > 0) + tail
            else:
                assert ops[-len(tail):] == tail     # after the final norm (rms_norm, Gemma's _offset) and the head
                assert any(op.startswith("rms_norm") for op in ops[-len(tail) - 2:-len(tail)])
