"""The buffer arena: every activation and per-step input of a forward pass in one device
allocation, laid out once from a table, addressed by name.

The layout is computed in plain Python (no GPU needed, so CI tests it); `Arena` allocates it.
Buffers that share a `storage` name share bytes: their lifetimes within a layer never overlap.

    storage   buffers            live from ... to ...
    hidden    hidden             embedding ... final norm (the residual stream)
    normed    normed             RMSNorm ... the next projection
              final_normed       final norm ... LM head
    proj      qkv                qkv_proj ... attention            (q, k, v side by side per row)
              gate_up            gate_up_proj ... silu_mul
              proj_out           o_proj / down_proj ... their norm (Gemma 3's norms of the
                                 attention and MLP outputs, before the residual add)
    mid       attn_out           attention ... o_proj
              act                silu_mul ... down_proj

The per-step inputs (token ids, positions, slot mapping, block tables, sampling parameters)
form one contiguous region mirrored in page-locked host memory, so a step uploads them with a
single copy. The region exists twice on the device (INPUT_BANKS), and steps take the banks in
turn: the next step's inputs go up into one bank on a copy stream while the step before it still
reads the other (gpu/input_banks.py), so no upload stands between two decode graphs. A decode step
has one token per sequence, so its per-token inputs have their own arrays of max-sequences
length (decode_*), placed with the per-sequence ones before the block tables, which are packed
with the batch's own width: a decode step's copy stops right after the rows in use (at batch 1,
a few hundred bytes). The prefill steps' per-token arrays (max-tokens
long: 256 KB at 16,384 tokens, whose transfer took ~7 us of every decode step when each
uploaded them: H200, 2026-12-04, 06f3a66) come after the block tables, and only prefill copies
cross them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.gpu.ops import (
    CASCADE,
    GEMV,
    GEMV_MAX_ROWS,
    MAX_ARGMAX_SLICES,
    MAX_CASCADE_SPLITS,
    MAX_DECODE_SPLITS,
    cascade_tiles,
)

ALIGN = 256                      # bytes; cuBLAS and 16-byte vector loads are happy with this
INPUT_BANKS = 2                  # device copies of the inputs region, used by steps in turn
CUBLAS_WORKSPACE_BYTES = 32 << 20


@dataclass(frozen=True)
class ArenaDims:
    tokens: int          # max new tokens in one step
    seqs: int            # max sequences in one step
    hidden: int
    q_width: int         # num_heads * head_dim
    qkv_width: int       # (num_heads + 2 * num_kv_heads) * head_dim
    inter: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    blocks_per_seq: int

    @classmethod
    def from_configs(cls, model: ModelConfig, engine: EngineConfig) -> ArenaDims:
        seqs = engine.max_num_seqs
        return cls(tokens=max(engine.max_num_batched_tokens, seqs), seqs=seqs,
                   hidden=model.hidden_size, q_width=model.q_size,
                   qkv_width=model.q_size + 2 * model.kv_size, inter=model.intermediate_size,
                   vocab=model.vocab_size, heads=model.num_attention_heads,
                   kv_heads=model.num_key_value_heads, head_dim=model.head_dim, blocks_per_seq=engine.max_blocks_per_seq(model))


def _cascade_tiles(d: ArenaDims) -> int:
    """attention_cascade_prefix's (q tile, kv head) pairs at the most sequences a step holds."""
    return cascade_tiles(d.seqs, d.heads, d.kv_heads)


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: Callable[[ArenaDims], tuple[int, ...]]
    dtype: str
    storage: str


BF16, F32, I32, U64 = "bfloat16", "float32", "int32", "uint64"
ITEMSIZE = {BF16: 2, F32: 4, I32: 4, U64: 8}

ACTIVATIONS = [
    BufferSpec("hidden", lambda d: (d.tokens, d.hidden), BF16, "hidden"),
    BufferSpec("normed", lambda d: (d.tokens, d.hidden), BF16, "normed"),
    BufferSpec("final_normed", lambda d: (d.seqs, d.hidden), BF16, "normed"),
    BufferSpec("qkv", lambda d: (d.tokens, d.qkv_width), BF16, "proj"),
    BufferSpec("gate_up", lambda d: (d.tokens, 2 * d.inter), BF16, "proj"),
    BufferSpec("proj_out", lambda d: (d.tokens, d.hidden), BF16, "proj"),
    BufferSpec("attn_out", lambda d: (d.tokens, d.q_width), BF16, "mid"),
    BufferSpec("act", lambda d: (d.tokens, d.inter), BF16, "mid"),
    BufferSpec("logits", lambda d: (d.seqs, d.vocab), F32, "logits"),
    BufferSpec("decode_partial_out", lambda d: (d.seqs, d.heads, MAX_DECODE_SPLITS, d.head_dim), F32, "decode_partial_out"),
    BufferSpec("decode_partial_ml", lambda d: (d.seqs, d.heads, MAX_DECODE_SPLITS, 2), F32, "decode_partial_ml"),
    BufferSpec("decode_split_counters", lambda d: (d.seqs, d.kv_heads), I32, "decode_split_counters"),
    # cascade decode (attention_cascade.cu): the suffix's base-2 log-sum-exp per (sequence, query
    # head), from attention_decode to the prefix kernel's merge
    BufferSpec("decode_lse", lambda d: (d.seqs, d.heads), F32, "decode_lse"),
    # the prefix kernel's split partials per (q tile x kv head, split, row): they live inside its
    # launch, attention_decode's inside its own, and a kernel touches them only after its PDL
    # wait, so the two share bytes; and its counters (per q tile x kv head, reset by the kernel)
    BufferSpec("cascade_partial_o", lambda d: (_cascade_tiles(d), MAX_CASCADE_SPLITS, CASCADE["BLOCK_Q"], d.head_dim),
               F32, "decode_partial_out"),
    BufferSpec("cascade_partial_ml", lambda d: (_cascade_tiles(d), MAX_CASCADE_SPLITS, CASCADE["BLOCK_Q"], 2),
               F32, "decode_partial_ml"),
    BufferSpec("cascade_split_counters", lambda d: (_cascade_tiles(d),), I32, "cascade_split_counters"),
    # the sampler's argmax pass split over blocks (sampling.cu): each slice's max / index / flag
    BufferSpec("argmax_partials", lambda d: (d.seqs, MAX_ARGMAX_SLICES, 4), I32, "argmax_partials"),
    BufferSpec("argmax_slice_counters", lambda d: (d.seqs,), I32, "argmax_slice_counters"),
    # the decode LM head's greedy argmax key per sequence (common.cuh's argmax_key), cleared by
    # the step's embedding; the sampler reads it instead of the logits
    BufferSpec("head_argmax", lambda d: (d.seqs,), U64, "head_argmax"),
    # the fused decode layer's handed-over norm (gpu/model.py): the residual GEMV's (or the
    # embedding's) per-CTA sums of squares of the new rows, for the GEMV after the norm
    BufferSpec("norm_row_ss", lambda d: (GEMV_MAX_ROWS, -(-d.hidden // GEMV["ROWS_PER_CTA"])), F32, "norm_row_ss"),
    BufferSpec("cublas_workspace", lambda d: (CUBLAS_WORKSPACE_BYTES // 4,), F32, "cublas_workspace"),
]

# Uploaded every step in one copy: a decode step's stops inside block_tables, so every decode
# input comes before it and the prefill-only arrays after it (see module docstring).
# async scheduling: token t's id is the previous step's sampled_ids[fed_rows[t]] where >= 0
TOKEN_INPUTS = ("token_ids", "positions", "slot_mapping", "fed_rows")   # a decode_ twin of each
INPUTS = [
    *(BufferSpec(f"decode_{name}", lambda d: (d.seqs,), I32, f"decode_{name}") for name in TOKEN_INPUTS),
    BufferSpec("query_start", lambda d: (d.seqs + 1,), I32, "query_start"),
    BufferSpec("context_lens", lambda d: (d.seqs,), I32, "context_lens"),
    BufferSpec("last_token_idx", lambda d: (d.seqs,), I32, "last_token_idx"),
    BufferSpec("temperature", lambda d: (d.seqs,), F32, "temperature"),
    BufferSpec("top_k", lambda d: (d.seqs,), I32, "top_k"),
    BufferSpec("top_p", lambda d: (d.seqs,), F32, "top_p"),
    BufferSpec("min_p", lambda d: (d.seqs,), F32, "min_p"),
    BufferSpec("seeds", lambda d: (d.seqs,), U64, "seeds"),
    BufferSpec("steps", lambda d: (d.seqs,), I32, "steps"),
    # a decode step's shared prefix in positions (ForwardBatch.common_prefix_blocks * block_size;
    # 0: none), which the cascade kernels read: one int, so one graph serves every prefix
    BufferSpec("cascade_prefix_len", lambda d: (1,), I32, "cascade_prefix_len"),
    BufferSpec("block_table_width", lambda d: (1,), I32, "block_table_width"),
    BufferSpec("block_tables", lambda d: (d.seqs, d.blocks_per_seq), I32, "block_tables"),
    *(BufferSpec(name, lambda d: (d.tokens,), I32, name) for name in TOKEN_INPUTS),
]

OUTPUTS = [
    BufferSpec("sampled_ids", lambda d: (d.seqs,), I32, "sampled_ids"),
]


@dataclass(frozen=True)
class Placement:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    storage: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * ITEMSIZE[self.dtype]


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def plan_layout(specs: list[BufferSpec], dims: ArenaDims, base: int = 0) -> tuple[dict[str, Placement], int]:
    """Place each storage group once (sized for its largest member) in table order.
    Returns the placements by name and the end offset."""
    group_size: dict[str, int] = {}
    for spec in specs:
        nbytes = int(np.prod(spec.shape(dims))) * ITEMSIZE[spec.dtype]
        group_size[spec.storage] = max(group_size.get(spec.storage, 0), nbytes)
    group_offset, offset = {}, round_up(base)
    for storage, size in group_size.items():      # dicts keep the table's order
        group_offset[storage] = offset
        offset = round_up(offset + size)
    placements = {s.name: Placement(s.name, group_offset[s.storage], s.shape(dims), s.dtype, s.storage)
                  for s in specs}
    return placements, offset


@dataclass(frozen=True)
class ArenaLayout:
    dims: ArenaDims
    activations: dict[str, Placement]
    inputs: dict[str, Placement]      # offsets relative to the inputs region
    outputs: dict[str, Placement]
    activation_bytes: int
    input_bytes: int
    output_bytes: int

    @classmethod
    def plan(cls, dims: ArenaDims) -> ArenaLayout:
        act, act_end = plan_layout(ACTIVATIONS, dims)
        inp, inp_end = plan_layout(INPUTS, dims)
        out, out_end = plan_layout(OUTPUTS, dims)
        return cls(dims, act, inp, out, act_end, inp_end, out_end)

    @property
    def total_bytes(self) -> int:
        return self.outputs_offset + self.output_bytes

    def inputs_offset(self, bank: int) -> int:
        """Where input bank `bank` starts (the banks lie back to back after the activations)."""
        if not 0 <= bank < INPUT_BANKS:
            raise ValueError(f"input bank must be in [0, {INPUT_BANKS}), got {bank}")
        return self.activation_bytes + bank * self.input_bytes

    @property
    def outputs_offset(self) -> int:
        return self.activation_bytes + INPUT_BANKS * self.input_bytes

    def views(self, base: int) -> dict[str | tuple[str, int], DeviceView]:
        """Every buffer as a DeviceView for an arena allocated at `base`: activations and outputs
        by name, inputs by (name, bank)."""
        views: dict[str | tuple[str, int], DeviceView] = {}
        for p in self.activations.values():
            views[p.name] = DeviceView(p.name, base + p.offset, p.shape, p.dtype)
        for p in self.outputs.values():
            views[p.name] = DeviceView(p.name, base + self.outputs_offset + p.offset, p.shape, p.dtype)
        for bank in range(INPUT_BANKS):
            for p in self.inputs.values():
                views[p.name, bank] = DeviceView(p.name, base + self.inputs_offset(bank) + p.offset, p.shape, p.dtype)
        return views

    def memory_map(self) -> str:
        lines = [f"{'region':<12}{'offset':>14}  {'bytes':>14}  {'buffer':<20}{'shape':<24}{'dtype':<9}storage"]
        regions = (("activations", 0, self.activations),
                   *((f"inputs[{b}]", self.inputs_offset(b), self.inputs) for b in range(INPUT_BANKS)),
                   ("outputs", self.outputs_offset, self.outputs))
        for region, base, placements in regions:
            for p in sorted(placements.values(), key=lambda p: (p.offset, p.name)):
                lines.append(f"{region:<12}{base + p.offset:>14,}  {p.nbytes:>14,}  {p.name:<20}"
                             f"{str(p.shape):<24}{p.dtype:<9}{p.storage}")
        lines.append(f"total {self.total_bytes:,} bytes ({self.total_bytes / 2**20:.1f} MiB)")
        return "\n".join(lines)


@dataclass(frozen=True)
class DeviceView:
    """A typed window into device memory. int(view) is the pointer kernels and cuBLAS take."""
    name: str
    ptr: int
    shape: tuple[int, ...]
    dtype: str

    def __int__(self) -> int:
        return self.ptr

    __index__ = __int__   # kernels' 'P' arguments and ctypes take the view itself


class Arena:
    """Allocates the planned layout once: activations + the input banks + outputs in one
    cuMemAlloc, with a page-locked host mirror of the inputs (one: it goes up into either bank)
    and of the outputs for single-copy transfers."""

    def __init__(self, layout: ArenaLayout):
        import pycuda.driver as drv
        self.layout = layout
        self._allocation = drv.mem_alloc(layout.total_bytes)
        base = int(self._allocation)
        # zeroed once: attention_decode's and attention_cascade_prefix's split counters and the
        # sampler's slice counters must start at 0 (each kernel resets its own)
        drv.memset_d8(base, 0, layout.total_bytes)
        self.base = base
        self.inputs_ptrs = [base + layout.inputs_offset(b) for b in range(INPUT_BANKS)]
        self.outputs_ptr = base + layout.outputs_offset
        self._views = layout.views(base)
        self.host_inputs_bytes = drv.pagelocked_empty(layout.input_bytes, np.uint8)
        self.host_outputs_bytes = drv.pagelocked_empty(layout.output_bytes, np.uint8)
        self._host = {p.name: _host_view(self.host_inputs_bytes, p) for p in layout.inputs.values()}
        self._host.update({p.name: _host_view(self.host_outputs_bytes, p) for p in layout.outputs.values()})

    def free(self) -> None:
        self._allocation.free()

    def view(self, name: str, bank: int | None = None) -> DeviceView:
        """An activation or output buffer by name; an input buffer by name and bank."""
        return self._views[name if bank is None else (name, bank)]

    def host(self, name: str) -> np.ndarray:
        """The page-locked host mirror of an input or output buffer."""
        return self._host[name]

    def upload_inputs(self, nbytes: int, bank: int, stream) -> None:
        """The host mirror's first nbytes into input bank `bank`, on `stream` (the copy engine)."""
        import pycuda.driver as drv
        drv.memcpy_htod_async(self.inputs_ptrs[bank], self.host_inputs_bytes[:nbytes], stream)

    def download_outputs(self, nbytes: int, stream) -> None:
        import pycuda.driver as drv
        drv.memcpy_dtoh_async(self.host_outputs_bytes[:nbytes], self.outputs_ptr, stream)

    def __str__(self) -> str:
        return self.layout.memory_map()


def _host_view(buffer: np.ndarray, p: Placement) -> np.ndarray:
    return buffer[p.offset:p.offset + p.nbytes].view(np.dtype(p.dtype)).reshape(p.shape)
