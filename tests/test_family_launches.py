"""Every model family's forward pass on the CUDA backend's launchers, checked on the CPU: the real
LlamaModel.forward and GpuOps launchers over test_trace.py's fake runner (address arithmetic, no
device), with a kernel library that looks each launched kernel up in the cuda/*.cu sources and
checks its arguments against the kernel's C signature (count and kind), its block size and its
shared memory. Prefill (cuBLAS) and decode at batch 1 and 3, on the fused decode layer and on
the nine-launch one; which kernels each family's layer launches; and cascade attention's two
launches in the decode steps that may share a prefix."""
from __future__ import annotations

from pathlib import Path

import pytest

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.gpu.kernels import find_kernel, kernel_signatures
from tinyvllm.gpu.step_shape import StepShape

FIXTURES = Path(__file__).parent / "fixtures" / "families"
MAX_SHARED = 227 * 1024            # an H100's dynamic shared memory per block


def _signature(name: str) -> str:
    filename, key = find_kernel(name)
    return kernel_signatures(filename)[key]


class _CheckedLaunches:
    """A kernel library whose kernels check their launches and record them: names in `launched`,
    (name, arguments) in `calls`."""

    def __init__(self):
        self.launched: list[str] = []
        self.calls: list[tuple[str, tuple]] = []
        self.grids: list[tuple[int, int, int]] = []      # each call's grid, in order

    def function(self, name):
        sig, launched, calls, grids = _signature(name), self.launched, self.calls, self.grids

        class Kernel:
            max_dynamic_shared_bytes = MAX_SHARED

            @staticmethod
            def launch(grid, block, stream, args, shared_bytes, pdl):
                assert len(args) == len(sig), f"{name}: {len(args)} arguments for its {len(sig)} ({sig})"
                for i, (code, arg) in enumerate(zip(sig, args)):
                    if code == "i":
                        assert isinstance(arg, int) and not isinstance(arg, bool), f"{name} argument {i}: {arg!r}"
                    elif code == "f":
                        assert isinstance(arg, (int, float)) and not isinstance(arg, bool), f"{name} argument {i}: {arg!r}"
                    else:
                        int(arg)                         # a pointer: an int or a device view
                assert 1 <= block[0] * block[1] * block[2] <= 1024 and min(grid) >= 1, (name, grid, block)
                assert shared_bytes <= MAX_SHARED, (name, shared_bytes)
                launched.append(name)
                calls.append((name, args))
                grids.append(grid)
        return Kernel


def _fake(config: ModelConfig, fused_decode: bool, max_num_seqs: int = 4):
    from test_trace import _FakeCudaRunner
    fake = _FakeCudaRunner(config, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                                max_model_len=256, fused_decode=fused_decode))
    fake.ops.library = _CheckedLaunches()
    return fake


def _step(fake, batch: ForwardBatch) -> list[str]:
    fake.ops.library.launched.clear()
    fake.model.forward(StepShape(batch.num_tokens, batch.num_seqs, batch.is_prefill,
                                 int(max(batch.query_start[1:] - batch.query_start[:-1]))))
    return list(fake.ops.library.launched)


def _configs():
    from tinyvllm.checkpoint.model_writer import preset_config
    return {"llama": preset_config("tiny"), **{f: ModelConfig.from_pretrained(FIXTURES / f)
                                               for f in ("gemma3", "mistral", "phi3", "qwen2", "qwen3", "smollm3")}}


# per family: the kernels a decode layer launches on the fused path besides the attention
FUSED_LAYER = {
    "llama": ["gemv_prenormed_rope_kv_bf16", "gemv_residual_norm_bf16", "gemv_prenormed_silu_mul_bf16",
              "gemv_residual_norm_bf16"],
    "mistral": ["gemv_prenormed_rope_kv_bf16", "gemv_residual_norm_bf16", "gemv_prenormed_silu_mul_bf16",
                "gemv_residual_norm_bf16"],
    "smollm3": ["gemv_prenormed_rope_kv_bf16", "gemv_residual_norm_bf16", "gemv_prenormed_silu_mul_bf16",
                "gemv_residual_norm_bf16"],
    "phi3": ["gemv_prenormed_rope_kv_bf16", "gemv_residual_norm_bf16", "gemv_prenormed_silu_mul_bf16",
             "gemv_residual_norm_bf16"],
    "qwen2": ["gemv_prenormed_rope_kv_bias_bf16", "gemv_residual_norm_bf16", "gemv_prenormed_silu_mul_bf16",
              "gemv_residual_norm_bf16"],
    "qwen3": ["gemv_prenormed_bf16", "rope_write_kv_qk_norm", "gemv_residual_norm_bf16",
              "gemv_prenormed_silu_mul_bf16", "gemv_residual_norm_bf16"],
    # the output norms need whole rows: o and down store their products, rms_norm_residual_add
    # normalises them into the residual and hands the next norm over
    "gemma3": ["gemv_prenormed_bf16", "rope_write_kv_qk_norm", "gemv_bf16", "rms_norm_residual_add",
               "gemv_prenormed_gelu_mul_bf16", "gemv_bf16", "rms_norm_residual_add"],
}
ROPE = {"llama": "rope_write_kv", "mistral": "rope_write_kv", "smollm3": "rope_write_kv", "phi3": "rope_write_kv", "qwen2": "rope_write_kv_bias",
        "qwen3": "rope_write_kv_qk_norm", "gemma3": "rope_write_kv_qk_norm"}
EMBEDDING = {"gemma3": "embedding_gather_scaled"}


def _attention(config: ModelConfig, kind: str) -> list[str]:
    """The attention kernels of the layers in order: window kernels on sliding layers."""
    group = config.num_attention_heads // config.num_key_value_heads
    shape = f"d{config.head_dim}" + (f"_g{group}" if kind == "decode" else "")
    return [f"attention_{kind}_window_{shape}" if config.layer_window(i) else f"attention_{kind}_{shape}"
            for i in range(config.num_hidden_layers)]


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
@pytest.mark.parametrize("family", sorted(FUSED_LAYER))
def test_every_launch_matches_its_kernel(family, fused_decode):
    config = _configs()[family]
    fake = _fake(config, fused_decode)
    L = config.num_hidden_layers
    prompt = ForwardBatch.build([list(range(1, 12)), [3, 4]], [11, 30], [[5], [6, 7]], 16, is_prefill=True)
    prefill = _step(fake, prompt)
    norm = "rms_norm_offset" if config.norm_weight_offset else "rms_norm"
    assert [op for op in prefill if op.startswith("attention_")] == _attention(config, "prefill")
    assert prefill.count(ROPE[family]) == L and prefill.count(norm) == 2 * L + 1
    assert prefill.count("rms_norm_residual_add") == 2 * L * config.sandwich_norms
    assert prefill.count("gelu_tanh_mul" if config.hidden_act == "gelu_tanh" else "silu_mul") == L
    for seqs in (1, 3):
        decode = _step(fake, ForwardBatch.build([[7]] * seqs, [12] * seqs, [[5]] * seqs, 16, is_prefill=False))
        assert [op for op in decode if op.startswith("attention_")] == _attention(config, "decode")
        layer = [op for op in decode if not op.startswith("attention_")]
        embedding = EMBEDDING.get(family, "embedding_gather")
        if fused_decode:
            assert layer == [embedding, *FUSED_LAYER[family] * L, "gemv_prenormed_bf16"], layer
        else:
            assert layer[0] == embedding and layer.count(ROPE[family]) == L and layer.count(norm) == 2 * L + 1


@pytest.mark.parametrize("family", sorted(FUSED_LAYER))
def test_mixed_step_gives_its_decode_rows_the_decode_attention(family):
    """A mixed step (the scheduler's decode rows first, then prompt chunks) launches, in each
    layer, attention_decode over its decode rows and attention_prefill over the chunks alone:
    the prefill launch's per-row inputs start at row D (query_start, context_lens and the block
    tables' row D at this step's width); a prefill step without leading one-token rows launches
    only attention_prefill, as before."""
    config = _configs()[family]
    fake = _fake(config, fused_decode=True)
    mixed = ForwardBatch.build([[7], [8], list(range(1, 12))], [12, 30, 40], [[5], [6, 7], [8, 9, 10]], 16,
                               is_prefill=True)
    shape = StepShape.of(mixed)
    assert (shape.decode_rows, shape.max_query_len, shape.table_width) == (2, 11, 3)
    calls, bank = fake.ops.library.calls, fake.model.inputs[0]
    calls.clear()
    fake.model.forward(shape)
    attention = [(name, args) for name, args in calls if name.startswith("attention_")]
    pairs = list(zip(_attention(config, "decode"), _attention(config, "prefill")))
    assert [name for name, _ in attention] == [name for pair in pairs for name in pair]
    for name, args in attention:
        pointers = {int(a) for a in args if not isinstance(a, float)}
        if name.startswith("attention_prefill"):
            assert {int(bank.query_start) + 8, int(bank.context_lens) + 8,
                    int(bank.block_tables) + 4 * 2 * 3} <= pointers, name
    only_one_token = StepShape.of(ForwardBatch.build([[7], [8]], [12, 30], [[5], [6, 7]], 16, is_prefill=True))
    assert (only_one_token.decode_rows, only_one_token.max_query_len) == (2, 1)
    prompt = StepShape.of(ForwardBatch.build([list(range(1, 12)), [3]], [11, 30], [[5], [6, 7]], 16, is_prefill=True))
    assert (prompt.decode_rows, prompt.max_query_len) == (0, 11)


@pytest.mark.parametrize("seqs", [8, 12], ids=["fused-8", "nine-launch-12"])
@pytest.mark.parametrize("family", sorted(FUSED_LAYER))
def test_cascade_decode_launches(family, seqs, small_cascade_rule):
    """A decode step of at least CASCADE_MIN_SEQS sequences gives every full-context layer
    cascade's two launches (gpu/model.py's cascades()), sliding layers the plain decode kernel:
    attention_decode reading the bank's cascade_prefix_len as first_position and writing
    decode_lse, then attention_cascade_prefix merging into attn_out with that lse, the prefix
    read through the bank's block tables (row 0) up to cascade_prefix_len, its split partials
    and counters the arena's cascade_* buffers; grid: one block per 64 query rows of a kv head
    per prefix split, cascade_splits() of them (132 SMs: 16 at these batches). Smaller decode
    steps (the batch-1 graph's) and prefill-kind steps launch no cascade kernel and pass null
    for both pointers."""
    from tinyvllm.engine.batch import CASCADE_MIN_SEQS
    from tinyvllm.gpu.kernels import waits_for_producer
    from tinyvllm.gpu.ops import CASCADE, MAX_CASCADE_SPLITS
    assert seqs >= CASCADE_MIN_SEQS and waits_for_producer("attention_cascade.cu")     # launched with PDL
    config = _configs()[family]
    fake = _fake(config, fused_decode=True, max_num_seqs=16)
    model, library, bank = fake.model, fake.ops.library, fake.model.inputs[0]
    prefix_len, lse, attn_out = int(bank.cascade_prefix_len), int(model.decode_lse), int(model.attn_out)
    workspace = [int(fake.arena.view(name)) for name in ("cascade_partial_o", "cascade_partial_ml",
                                                         "cascade_split_counters")]
    group = config.num_attention_heads // config.num_key_value_heads
    decode = ForwardBatch.build([[7]] * seqs, [40] * seqs, [[5, 6, 7]] * seqs, 16, is_prefill=False)
    assert model.fused(StepShape.of(decode)) == (seqs <= 8)
    library.calls.clear()
    library.grids.clear()
    _step(fake, decode)
    attention = [(name, args, grid) for (name, args), grid in zip(library.calls, library.grids)
                 if name.startswith("attention_")]
    want = []
    for layer, name in enumerate(_attention(config, "decode")):
        want.append(name)
        if not config.layer_window(layer):
            want.append(f"attention_cascade_prefix_d{config.head_dim}")
    assert [name for name, _, _ in attention] == want
    for i, (name, args, grid) in enumerate(attention):
        params = [p.split()[-1].lstrip("*") for p in _parameters(name)]
        arg = dict(zip(params, args))
        if name.startswith("attention_cascade_prefix"):
            assert attention[i - 1][0].startswith("attention_decode_d"), "right after a full-context decode"
            assert int(arg["out"]) == attn_out and int(arg["lse"]) == lse and int(arg["prefix_len"]) == prefix_len
            assert int(arg["block_tables"]) == int(bank.block_tables) and arg["num_seqs"] == seqs
            assert arg["group"] == group and int(arg["q"]) == int(model.qkv)
            assert [int(arg[p]) for p in ("partial_o", "partial_ml", "split_counters")] == workspace
            tiles = -(-seqs * group // CASCADE["BLOCK_Q"]) * config.num_key_value_heads
            splits = min(-(-2 * 132 // tiles), MAX_CASCADE_SPLITS)
            assert splits == fake.ops.cascade_splits(seqs, config.num_attention_heads, config.num_key_value_heads)
            assert grid == (-(-seqs * group // CASCADE["BLOCK_Q"]), config.num_key_value_heads, splits)
        elif "_window_" in name:
            assert int(arg["first_position"]) == 0 and int(arg["lse_out"]) == 0
        else:
            assert int(arg["first_position"]) == prefix_len and int(arg["lse_out"]) == lse
    for batch in (ForwardBatch.build([[7]] * 3, [40] * 3, [[5, 6, 7]] * 3, 16, is_prefill=False),
                  ForwardBatch.build([[7]] * seqs, [40] * seqs, [[5, 6, 7]] * seqs, 16, is_prefill=True)):
        library.calls.clear()
        fake.model.forward(StepShape.of(batch))
        assert not any(name.startswith("attention_cascade") for name, _ in library.calls)
        for name, args in library.calls:
            if name.startswith("attention_decode"):
                arg = dict(zip([p.split()[-1].lstrip("*") for p in _parameters(name)], args))
                assert int(arg["first_position"]) == 0 and int(arg["lse_out"]) == 0


def _parameters(name: str) -> tuple[str, ...]:
    from tinyvllm.gpu.kernels import kernel_parameters
    filename, key = find_kernel(name)
    return kernel_parameters(filename)[key]
