"""The arena's layout (planned without a GPU) and the device weight layout."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tinyvllm.checkpoint.model_writer import preset_config
from tinyvllm.config import EngineConfig
from tinyvllm.gpu.arena import ACTIVATIONS, ALIGN, INPUTS, TOKEN_INPUTS, ArenaDims, ArenaLayout
from tinyvllm.gpu.device_weights import device_tensor_shapes

# Buffers that one kernel or GEMM reads and writes together, or that are live across each
# other's lifetimes; none of these pairs may share bytes.
LIVE_TOGETHER = [
    ("hidden", "normed"), ("hidden", "qkv"), ("hidden", "attn_out"), ("hidden", "gate_up"),
    ("hidden", "act"), ("hidden", "final_normed"), ("normed", "qkv"), ("normed", "gate_up"),
    ("qkv", "attn_out"), ("gate_up", "act"), ("final_normed", "logits"),
    ("attn_out", "decode_partial_out"), ("decode_partial_out", "decode_partial_ml"),
    ("attn_out", "decode_lse"), ("qkv", "decode_lse"),        # cascade: decode -> the prefix kernel's merge
    # the prefix kernel reads q, out and lse while it stores and merges its split partials
    *((name, ws) for name in ("qkv", "attn_out", "decode_lse", "cascade_split_counters")
      for ws in ("cascade_partial_o", "cascade_partial_ml")),
    ("cascade_partial_o", "cascade_partial_ml"),
]


@pytest.fixture(params=["tiny", "llama-3.2-1b", "llama-3.1-8b"])
def layout(request):
    cfg = preset_config(request.param)
    return ArenaLayout.plan(ArenaDims.from_configs(cfg, EngineConfig(max_model_len=4096)))


def _overlap(a, b):
    return a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


def test_live_buffers_never_overlap(layout):
    for a, b in LIVE_TOGETHER:
        assert not _overlap(layout.activations[a], layout.activations[b]), (a, b)


def test_only_declared_storage_is_shared(layout):
    for group in (layout.activations, layout.inputs, layout.outputs):
        for a, b in itertools.combinations(group.values(), 2):
            assert _overlap(a, b) == (a.storage == b.storage), (a.name, b.name)


def test_alignment_and_sizes(layout):
    for p in itertools.chain(layout.activations.values(), layout.inputs.values()):
        assert p.offset % ALIGN == 0
    assert max(p.offset + p.nbytes for p in layout.activations.values()) <= layout.activation_bytes
    # a decode step's upload stops inside block_tables (gpu/input_banks.py's _stage_inputs): every input
    # a decode step uses lies before it, and only the prefill per-token arrays after it
    names = [s.name for s in INPUTS]
    after = names[names.index("block_tables") + 1:]
    assert sorted(after) == sorted(TOKEN_INPUTS), after
    assert all(f"decode_{n}" in names[:names.index("block_tables")] for n in TOKEN_INPUTS)
    dims_seqs = layout.inputs["decode_token_ids"].nbytes // 4
    assert all(layout.inputs[f"decode_{n}"].nbytes == dims_seqs * 4 for n in TOKEN_INPUTS)
    assert {s.name for s in ACTIVATIONS} == set(layout.activations)


def test_memory_map_lists_every_buffer(layout):
    text = layout.memory_map()
    for name in itertools.chain(layout.activations, layout.inputs, layout.outputs):
        assert name in text
    assert "MiB" in text.splitlines()[-1]


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b", "llama-3.1-8b"])
def test_device_weights_hold_every_parameter(preset):
    cfg = preset_config(preset)
    shapes = device_tensor_shapes(cfg)
    n = sum(int(np.prod(s)) for k, s in shapes.items() if k != "rope_inv_freq")
    assert n == cfg.num_parameters


def test_views_place_each_input_bank_apart(layout):
    """ArenaLayout.views: every buffer inside the arena; the two input banks hold the same
    buffers at the same offsets within their bank, and no byte of one lies in the other."""
    from tinyvllm.gpu.arena import INPUT_BANKS
    base = 1 << 40
    views = layout.views(base)
    nbytes = {p.name: p.nbytes for g in (layout.activations, layout.inputs, layout.outputs) for p in g.values()}
    for key, v in views.items():
        assert base <= v.ptr and v.ptr + nbytes[v.name] <= base + layout.total_bytes, key
    banks = [[views[name, b] for name in layout.inputs] for b in range(INPUT_BANKS)]
    for b in range(1, INPUT_BANKS):
        assert all(v.ptr - w.ptr == b * layout.input_bytes for v, w in zip(banks[b], banks[0]))
    first_end = max(v.ptr + nbytes[v.name] for v in banks[0])
    assert first_end <= min(v.ptr for v in banks[1])
