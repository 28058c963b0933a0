"""Is one persistent launch per layer for o -> gate_up -> down faster than the engine's three GEMVs?

    python3 benchmarks/persistent_mlp_probe.py [--layers 16] [--repeats 50] [--rounds 5]
                                               [--variant NAME=INT[,NAME=INT] ...]

The probe of docs/perf-notes.md's session 16 design (written again after session 18's branch was
lost): at batch 1 on Llama-3.2-1B's shapes (hidden 2,048, intermediate 8,192, bf16), --layers
layers of the decode layer's MLP half, each layer with weights of its own (109 MB a layer, 1.75 GB
for 16: every byte comes from HBM, L2 holds 50-60 MB), timed four ways inside CUDA graphs:

  A  the engine as it is: gemv_residual_norm (o), gemv_prenormed_silu_mul (gate_up),
     gemv_residual_norm (down), through gpu/ops.py's launchers with the engine's k-splits
     (decode_k_warps), PDL on: what the decode layer runs, norms handed over included;
  B  the same kernels without the norms, as the probe computes: gemv_bf16 accumulating (o),
     gemv_silu_mul_bf16 (gate_up), gemv_bf16 accumulating (down), PDL, the probe's k-splits:
     the like-for-like comparison;
  probe, a launch a layer: persistent_mlp.cu's kernel, one 32-warp CTA per SM, the three phases
     handing over by counters in global memory, each warp's first ring of the next phase's
     weights copied before its wait; the layers' launches chained by PDL;
  probe, one launch: all layers in one launch, counters between the layers too.

The chain keeps two bf16 residual streams, p and q (o: q += p @ W_o^T; gate_up: act =
silu(gate) * up of q @ W_gu^T; down: p += act @ W_d^T), so no kernel reads what it writes and
each layer depends on the one before (the .cu's header). Before timing, every graph is replayed
with two random inputs: the probe's p, q and act must equal B's bit for bit (the probe keeps each
output's summation order), and B (so the probe too) must match a numpy float32 twin of the
chain within a tolerance derived from the bf16 roundings (reference_chain, tolerance());
A must be finite and replay identically. Anything else prints WRONG and exits 1; so do counters
left otherwise than the reset plan says after the replays (counter_plan()). Then each graph is
timed: --repeats back-to-back replays between two events, --rounds rounds alternating the four
graphs, the median round reported as µs per layer, µs per 16-layer step, the weights' TB/s, and
the difference to A and B. Last, the one-launch probe runs once more with warp 0's marks (the
.cu's timeline: clock64 and %globaltimer at each phase's start, its wait's pass and its team's
bump) and a table says, per phase, how long warp 0 waited, how long its tile took from the pass
to the bump, how long after the stage before's last bump anywhere each CTA passed, and how long
a stage took from its first pass to its last bump: where session 20's lost 13 µs a layer go.
--variant times the probe (a launch a layer) once more per variant, with some of the .cu's
switches rewritten in a copy (VARIANT_SWITCHES: POLL_SLEEP_NS, WIDE_L2, POLLER_WAITS_FIRST),
each checked bit for bit like the rest.
Session 18's prediction: the probe −0.5 to −2 µs a layer on the
H100; under 1 µs a layer saved, the integration is not worth building.
Session 20 (one H100, 18 s in all): bitwise equal to B, and 52.7 µs a layer against B's 39.4
— 13 µs a layer slower, the prediction failed (docs/perf-notes.md has the variants that narrow
down where the loss is not; the timeline table came after that run and has not run yet).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.gpu.kernels import kernel_constants  # noqa: E402 — text only, no CUDA needed
from tinyvllm.reference.kernels import bf16_round, silu_mul  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "persistent_mlp_probe.cu"
KERNEL = "persistent_mlp"
PROBE = kernel_constants(str(SOURCE))    # the kernel's launch facts, read from the .cu itself
HIDDEN, INTERMEDIATE = PROBE["HIDDEN"], PROBE["INTERMEDIATE"]
STEP_LAYERS = 16          # Llama-3.2-1B's layers: "µs per step" is 16 layers' worth
EPS = 1e-5                # A's handed-over norm (Llama's rms_norm_eps)
# Random weights: sign and 7 mantissa bits random, the exponent fixed, so |w| in [2^e, 2^(e+1))
# (E[w^2] ~ 2.3 * 4^e; a product's gain ~ 1.5 * 2^e * sqrt(k)). These give o ~0.2-0.3 of q's size
# per layer and down ~0.1-0.2 of p's, so a missing or wrong phase moves the streams by tens of
# bf16 ulps (the check has teeth), while gate_up's product, quadratic in q, grows the values only
# slowly: max |value| ~4-8 over 16 layers, ~300 over 64 (a float32 simulation with these gains).
W_EXPONENT = {"o": -8, "gate_up": -7, "down": -8}
# the numpy check's tolerance in bf16 ulps of the stream's largest value: tolerance()
TOLERANCE_ULPS = 4
# the .cu's constants a --variant may rewrite: switches that change neither a shape nor a launch
# fact the host reads from PROBE (threads, shared memory, counters, timeline)
VARIANT_SWITCHES = ("POLL_SLEEP_NS", "WIDE_L2", "POLLER_WAITS_FIRST")


@dataclass(frozen=True)
class PhaseShape:
    """One phase of the persistent kernel (the .cu's Shape<P>): its k-split and matrix."""
    name: str
    k_warps: int       # warps per team (the tile's k-split)
    k: int
    rows: int          # W rows = outputs (gate_up: gate and up rows)
    barrier: int       # the first named barrier id of its teams

    @property
    def tiles(self) -> int:
        return self.rows // PROBE["TILE_ROWS"]

    @property
    def teams(self) -> int:
        return PROBE["WARPS"] // self.k_warps

    @property
    def steps(self) -> int:
        return self.k // PROBE["STEP_K"]


def phases(c: dict[str, int] = PROBE) -> list[PhaseShape]:
    return [PhaseShape("o", c["O_K_WARPS"], c["HIDDEN"], c["HIDDEN"], c["O_BARRIER"]),
            PhaseShape("gate_up", c["GATE_UP_K_WARPS"], c["HIDDEN"], 2 * c["INTERMEDIATE"], c["GATE_UP_BARRIER"]),
            PhaseShape("down", c["DOWN_K_WARPS"], c["INTERMEDIATE"], c["HIDDEN"], c["DOWN_BARRIER"])]


def team_tiles(phase: PhaseShape, cta: int, team: int, ctas: int) -> list[int]:
    """The tiles team `team` of CTA `cta` runs, in order: the kernel's loop in run_phase."""
    return list(range(cta + ctas * team, phase.tiles, ctas * phase.teams))


def tile_rows(phase: PhaseShape, tile: int) -> list[int]:
    """The 16 W rows (outputs) of a tile, in tile column order: the kernel's row_a + 0..7, row_b +
    0..7 (gemv.cu's cta_tile: gate_up pairs 8 gate rows with their 8 up rows)."""
    if phase.name == "gate_up":
        row_a, row_b = tile * 8, phase.rows // 2 + tile * 8
    else:
        row_a, row_b = tile * PROBE["TILE_ROWS"], tile * PROBE["TILE_ROWS"] + 8
    return [row_a + c for c in range(8)] + [row_b + c for c in range(8)]


def warp_steps(phase: PhaseShape, member: int) -> range:
    """The k steps warp `member` of a team walks (gemv.cu's split: [w*S/kw, (w+1)*S/kw))."""
    return range(member * phase.steps // phase.k_warps, (member + 1) * phase.steps // phase.k_warps)


def shared_bytes(c: dict[str, int] = PROBE) -> int:
    """The dynamic shared memory a CTA needs, from first principles: each warp's ring of
    RING_STEPS slots (W rows g and g + 8 for 32 lanes, x row 0 for the 4 lanes g = 0, 16 bytes
    each) and its fp32 partial row per phase (16 outputs)."""
    slot = (2 * 32 + 4) * 16
    return c["WARPS"] * (c["RING_STEPS"] * slot + c["PHASES"] * c["TILE_ROWS"] * 4)


def layer_weight_bytes(hidden: int = HIDDEN, inter: int = INTERMEDIATE) -> int:
    return 2 * (hidden * hidden + 2 * inter * hidden + hidden * inter)


@dataclass(frozen=True)
class Launch:
    """One persistent launch of a chain: its layers, where its counters start and which counter
    it zeroes after its griddepcontrol.wait (indices into the chain's counters; None: none)."""
    first_layer: int
    layers: int
    counters: int
    reset: int | None


def counter_plan(layers: int, one_launch: bool) -> list[Launch]:
    """The launches of a chain of `layers` layers and their counters (3 per layer: stage s =
    3 * layer + phase bumps counter s, the stage after polls it). Inside a launch, stage s zeroes
    counter s - 2 (the .cu's header: every poller of it has passed); the counter two stages
    before a launch's first stage — the last one polled in the launch before it — is zeroed by
    that launch's stage 0 once griddepcontrol.wait has seen the launch before complete. The first
    launch zeroes the chain's last launch's counter: the previous replay's, complete before any
    of this replay's graph starts (graph launches in one stream do not overlap). So every replay
    finds its counters zero where it bumps them and leaves them as counters_after_replay says."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if one_launch:
        return [Launch(0, layers, 0, 3 * layers - 2)]
    return [Launch(l, 1, 3 * l, 3 * ((l - 1) % layers) + 1) for l in range(layers)]


def counters_after_replay(layers: int) -> np.ndarray:
    """What a replay leaves in the chain's 3 * layers counters (either plan): zeros, but for the
    counter of the last layer's gate_up, which the last down polled and which the next replay's
    first stage zeroes (counter_plan); it holds gate_up's tile count."""
    left = np.zeros(3 * layers, np.uint32)
    left[3 * layers - 2] = phases()[1].tiles
    return left


TIMELINE_POISON = np.uint64(2**64 - 1)   # a stage whose CTA has no tile keeps it


def timeline_summary(timeline: np.ndarray) -> tuple[list[dict], float]:
    """What one launch's timeline (the .cu's TIMELINE_FIELDS per CTA and stage, [ctas, stages,
    fields], TIMELINE_POISON where a CTA had no tile) says per phase, in µs:
      wait     warp 0 from the phase's start to its wait's pass (its W copies go out first),
      tile     from the pass to its team's bump (X copies, the ring, the team barrier, epilogue),
      handoff  from the stage before's last bump anywhere to this CTA's pass (%globaltimer),
      stage    from the first CTA's pass to the last CTA's bump (%globaltimer),
    each as (median, max) over the CTAs and layers (stage: over layers), plus each CTA's SM clock
    from its clock64 and %globaltimer deltas between its first pass and last bump. Stage 0 has
    no stage before it in the launch, so it gives no handoff. -> (rows, the median clock in GHz)."""
    fields = int(PROBE["TIMELINE_FIELDS"])
    if timeline.ndim != 3 or timeline.shape[2] != fields:
        raise ValueError(f"timeline must be [ctas, stages, {fields}], got {timeline.shape}")
    ctas, stages, _ = timeline.shape
    valid = timeline[:, :, 1] != TIMELINE_POISON           # the CTA passed the stage (had a tile)
    t = timeline.astype(np.float64)
    ghz = np.empty(ctas)
    for c in range(ctas):
        seen = np.flatnonzero(valid[c])
        first, last = seen[0], seen[-1]
        ghz[c] = (t[c, last, 2] - t[c, first, 1]) / (t[c, last, 4] - t[c, first, 3])
    rows = []
    for phase_index, phase in enumerate(phases()):
        cols = [s for s in range(stages) if s % 3 == phase_index]
        waits, tiles, handoffs, spans = [], [], [], []
        for s in cols:
            mine = valid[:, s]
            waits += list((t[mine, s, 1] - t[mine, s, 0]) / ghz[mine] / 1e3)
            tiles += list((t[mine, s, 2] - t[mine, s, 1]) / ghz[mine] / 1e3)
            spans.append((t[mine, s, 4].max() - t[mine, s, 3].min()) / 1e3)
            if s > 0:
                last_bump = t[valid[:, s - 1], s - 1, 4].max()
                handoffs += list((t[mine, s, 3] - last_bump) / 1e3)
        stat = lambda v: (float(np.median(v)), float(np.max(v))) if v else (float("nan"), float("nan"))  # noqa: E731
        rows.append({"phase": phase.name, "wait": stat(waits), "tile": stat(tiles), "handoff": stat(handoffs),
                     "stage": stat(spans)})
    return rows, float(np.median(ghz))


# ---- bf16 on the host: the device's bits <-> float32 (ml_dtypes rounds to nearest even, as
# __float2bfloat16); bf16_round and silu_mul are the reference twins' (reference/kernels.py)
def to_bf16_bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def from_bf16_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def reference_chain(p: np.ndarray, q: np.ndarray, layer_weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The numpy float32 twin of the chain B and the probe run: p, q float32 [batch, hidden]
    holding bf16 values; layer_weights yields each layer's (W_o, W_gu, W_d) as bf16 bits (uint16).
    Every value the GPU stores in bf16 is rounded here at the same point: q and p after each
    residual add (the fp32 sum of the old value and the product, rounded once), gate and up
    before silu (gemv_silu_mul reads them as the unfused chain would), act. Returns (p, q, act)."""
    act = None
    for w_o, w_gu, w_d in layer_weights:
        q = bf16_round(q + p @ from_bf16_bits(w_o).T)
        gate_up = q @ from_bf16_bits(w_gu).T
        half = gate_up.shape[-1] // 2
        act = bf16_round(silu_mul(bf16_round(gate_up[:, :half]), bf16_round(gate_up[:, half:])))
        p = bf16_round(p + act @ from_bf16_bits(w_d).T)
    return p, q, act


def tolerance(ref: np.ndarray) -> float:
    """The largest |GPU - twin| accepted for one stream. The twin rounds to bf16 wherever the GPU
    does, so they differ only where an fp32 sum taken in another order (the tensor cores' k-split
    and mma order against numpy's BLAS; |difference| <= k * 2^-24 * sum |w x|, ~2^-11 relative at
    worst for k = 8,192, typically far less) or a fast intrinsic (__expf, __fdividef: 2 ulp fp32)
    lands on the other side of a bf16 rounding boundary: that intermediate is then one bf16 ulp
    (2^-8 relative) off. Each such flip moves the later values by about one ulp of the value it
    feeds into, and the chain (W_EXPONENT) neither grows nor amplifies much over the layers, so a
    handful of flips stays within a few ulps of the stream's largest value: TOLERANCE_ULPS of
    them. A wiring error (a wrong pointer, a skipped layer, a stale read) is O(1), far above."""
    return TOLERANCE_ULPS * 2.0 ** -8 * float(np.max(np.abs(ref)))


def random_bf16_bits(rng: np.random.Generator, shape, exponent: int) -> np.ndarray:
    """bf16 bits with a random sign and mantissa and the exponent fixed (W_EXPONENT)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= np.uint16(0x807F)
    bits |= np.uint16((127 + exponent) << 7)
    return bits


def random_stream(rng: np.random.Generator, hidden: int = HIDDEN) -> np.ndarray:
    """One bf16-valued float32 residual stream [1, hidden], standard normal."""
    return bf16_round(rng.standard_normal((1, hidden), dtype=np.float32))


# ---- the GPU side ---------------------------------------------------------------------------
def variant_constants(spec: str) -> dict[str, int]:
    """--variant "NAME=INT[,NAME=INT]" -> {NAME: INT}, for VARIANT_SWITCHES only."""
    from constant_sweep import parse_variant
    values = parse_variant(spec)
    for name in values:
        if name not in VARIANT_SWITCHES:
            raise ValueError(f"variant {spec!r}: {name} is not one of {', '.join(VARIANT_SWITCHES)}")
    return values


def load_probe(kernels, library, variant: dict[str, int] | None = None, workdir: Path | None = None):
    """The persistent kernel (`variant`'s constants rewritten in a copy under workdir, as
    handoff_bench does), compiled with the engine's options, its shared memory allowed, and
    checked to fit one CTA on every SM at once (the counters' spins need every CTA resident)."""
    from constant_sweep import rewrite_constants

    from tinyvllm.gpu import driver
    source = SOURCE
    if variant:
        source = Path(tempfile.mkdtemp(dir=workdir)) / SOURCE.name
        source.write_text(rewrite_constants(SOURCE.read_text(), variant))
    module = kernels.load_module(source, library.arch, library.options)
    signature = kernels.kernel_signatures(str(SOURCE))[KERNEL]
    kernel = kernels.Kernel.from_module(module, SOURCE.name, KERNEL, signature, kernels.waits_for_producer(str(SOURCE)))
    kernel.set_max_dynamic_shared_bytes(PROBE["SHARED_BYTES"])
    lib = driver.libcuda()
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                                ctypes.c_int, ctypes.c_size_t]
    lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    per_sm = ctypes.c_int()
    driver.check(lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(per_sm), kernel.handle,
                                                                 PROBE["THREADS"], PROBE["SHARED_BYTES"]),
                 "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    facts = {}
    for name, attribute in (("registers", 4), ("local bytes", 3), ("static shared bytes", 1)):   # CU_FUNC_ATTRIBUTE_*
        value = ctypes.c_int()
        driver.check(lib.cuFuncGetAttribute(ctypes.byref(value), attribute, kernel.handle), "cuFuncGetAttribute")
        facts[name] = value.value
    if per_sm.value < 1:
        raise SystemExit(f"{KERNEL}: no CTA of {PROBE['THREADS']} threads and {PROBE['SHARED_BYTES']} bytes fits an SM "
                         f"({facts}); its counters would spin forever")
    return kernel, per_sm.value, facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=STEP_LAYERS, help="layers in each chain (default 16)")
    ap.add_argument("--repeats", type=int, default=50, help="back-to-back replays between two events")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds, the graphs alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=INT[,NAME=INT]",
                    help="also time the probe (a launch a layer) with these constants of the .cu rewritten, "
                         f"checked like the others; one of {', '.join(VARIANT_SWITCHES)}; repeatable")
    args = ap.parse_args()
    if args.layers < 1 or args.repeats < 1 or args.rounds < 1:
        ap.error("--layers, --repeats and --rounds must be >= 1")
    try:
        variants = {f"probe/layer {spec}": variant_constants(spec) for spec in args.variant}
    except ValueError as e:
        ap.error(str(e))

    from handoff_bench import replay_us  # one replay timer for the benchmarks' graphs

    from tinyvllm.gpu import kernels
    from tinyvllm.gpu.driver import CudaDevice
    from tinyvllm.gpu.graphs import CudaGraph
    from tinyvllm.gpu.ops import GpuOps

    t_start = time.perf_counter()
    L, H, I = args.layers, HIDDEN, INTERMEDIATE
    shapes = {ph.name: ph for ph in phases()}
    device = CudaDevice()
    with device.active(), tempfile.TemporaryDirectory() as workdir:
        drv = device.drv
        stream = drv.Stream()
        library = kernels.KernelLibrary()
        ops = GpuOps(library, stream=stream, num_sms=device.num_sms)
        probe, per_sm, facts = load_probe(kernels, library)
        probe_kernels = {"probe/layer": probe, "probe/one": probe,
                         **{name: load_probe(kernels, library, v, Path(workdir))[0] for name, v in variants.items()}}
        ctas = device.num_sms
        engine_kw = {name: ops.decode_k_warps(name, n, k)
                     for name, n, k in (("o", H, H), ("gate_up", 2 * I, H), ("down", H, I))}
        print(f"{device.name}, {ctas} SMs; {KERNEL}: {facts['registers']} registers, {facts['local bytes']} bytes "
              f"local, {PROBE['SHARED_BYTES']} + {facts['static shared bytes']} bytes shared, {per_sm} CTA(s) of "
              f"{PROBE['THREADS']} threads per SM; compiled in {time.perf_counter() - t_start:.0f} s")
        print(f"k-splits: probe and B {[ph.k_warps for ph in phases()]} (o, gate_up, down), "
              f"the engine (A) {list(engine_kw.values())}")

        # weights: one pool per matrix, layer l at l * its size; host copies for the numpy twin
        rng = np.random.default_rng(args.seed)
        sizes = {"o": H * H, "gate_up": 2 * I * H, "down": H * I}
        pools = {name: drv.mem_alloc(2 * L * size) for name, size in sizes.items()}
        host = []
        for layer in range(L):
            mats = {name: random_bf16_bits(rng, (shapes[name].rows, shapes[name].k), W_EXPONENT[name])
                    for name in sizes}
            for name, bits in mats.items():
                drv.memcpy_htod(int(pools[name]) + 2 * layer * sizes[name], bits)
            host.append((mats["o"], mats["gate_up"], mats["down"]))
        w_at = lambda name, layer: int(pools[name]) + 2 * layer * sizes[name]  # noqa: E731
        print(f"weights: {L} layers x {layer_weight_bytes() / 1e6:.1f} MB = {L * layer_weight_bytes() / 1e9:.2f} GB "
              f"(t = {time.perf_counter() - t_start:.0f} s)")

        def stream_buffers():
            return {"p": drv.mem_alloc(2 * H), "q": drv.mem_alloc(2 * H), "act": drv.mem_alloc(2 * I)}

        bufs = {v: stream_buffers() for v in ("A", "B", *probe_kernels)}
        # A's handed-over norms: normed rows and their sums of squares, both ways; gains of 1
        norm_gain = drv.to_device(to_bf16_bits(np.ones(H, np.float32)))
        normed = [drv.mem_alloc(2 * H) for _ in range(2)]
        row_ss = [drv.mem_alloc(4 * H // PROBE["TILE_ROWS"]) for _ in range(2)]
        counters = {v: drv.mem_alloc(4 * PROBE["COUNTER_STRIDE"] * 3 * L) for v in probe_kernels}
        for c in counters.values():
            drv.memset_d32(c, 0, PROBE["COUNTER_STRIDE"] * 3 * L)

        def chain_a():
            b = bufs["A"]
            for layer in range(L):   # model.py's _decode_layer_fused with the norms handed over
                ops.gemv_residual_norm(b["q"], normed[0], w_at("o", layer), 1, H, H, norm_gain, normed[1], row_ss[1],
                                       k_warps=engine_kw["o"])
                ops.gemv_silu_mul(b["act"], normed[1], w_at("gate_up", layer), 1, 2 * I, H, prenormed=(row_ss[1], EPS),
                                  k_warps=engine_kw["gate_up"])
                ops.gemv_residual_norm(b["p"], b["act"], w_at("down", layer), 1, H, I, norm_gain, normed[0], row_ss[0],
                                       k_warps=engine_kw["down"])

        def chain_b():
            b = bufs["B"]
            for layer in range(L):
                ops.gemv(b["q"], b["p"], w_at("o", layer), 1, H, H, accumulate=True, k_warps=shapes["o"].k_warps)
                ops.gemv_silu_mul(b["act"], b["q"], w_at("gate_up", layer), 1, 2 * I, H,
                                  k_warps=shapes["gate_up"].k_warps)
                ops.gemv(b["p"], b["act"], w_at("down", layer), 1, H, I, accumulate=True, k_warps=shapes["down"].k_warps)

        def chain_probe(variant: str, timeline: int = 0):
            b, base = bufs[variant], int(counters[variant])
            counter = lambda i: base + 4 * PROBE["COUNTER_STRIDE"] * i  # noqa: E731
            for launch in counter_plan(L, one_launch=variant == "probe/one"):
                args_ = (b["p"], b["q"], b["act"], w_at("o", launch.first_layer), w_at("gate_up", launch.first_layer),
                         w_at("down", launch.first_layer), launch.layers, counter(launch.counters),
                         counter(launch.reset) if launch.reset is not None else 0, timeline)
                probe_kernels[variant].launch((ctas, 1, 1), (PROBE["THREADS"], 1, 1), stream.handle, args_,
                                              PROBE["SHARED_BYTES"], pdl=True)

        chains = {"A": chain_a, "B": chain_b,
                  **{name: (lambda name=name: chain_probe(name)) for name in probe_kernels}}
        graphs = {}
        for name, enqueue in chains.items():
            enqueue()            # eagerly once: the launchers set their shared memory outside a capture
            stream.synchronize()
            with CudaGraph.capture(stream) as graph:
                enqueue()
            graphs[name] = graph

        def upload(p0: np.ndarray, q0: np.ndarray) -> None:
            for b in bufs.values():
                drv.memcpy_htod(b["p"], to_bf16_bits(p0))
                drv.memcpy_htod(b["q"], to_bf16_bits(q0))
            drv.memcpy_htod(normed[0], to_bf16_bits(p0))   # A's o reads bf16(p * gain), gain 1

        def download(name: str) -> dict[str, np.ndarray]:
            out = {}
            for key, n in (("p", H), ("q", H), ("act", I)):
                out[key] = np.empty(n, np.uint16)
                drv.memcpy_dtoh(out[key], bufs[name][key])
            return out

        # ---- correctness: two inputs, each graph replayed on both -----------------------------
        wrong = []
        inputs = [(random_stream(rng), random_stream(rng)) for _ in range(2)]
        results = []
        for p0, q0 in inputs:
            got = {}
            for name, graph in graphs.items():
                upload(p0, q0)
                graph.launch(stream)
                stream.synchronize()
                got[name] = download(name)
            results.append(got)
        upload(*inputs[0])   # A's determinism: the first input once more
        graphs["A"].launch(stream)
        stream.synchronize()
        a_again = download("A")
        ref_p, ref_q, ref_act = reference_chain(np.concatenate([i[0] for i in inputs]),
                                                np.concatenate([i[1] for i in inputs]), host)
        print(f"checks (t = {time.perf_counter() - t_start:.0f} s): bf16 ulps of the stream's largest value, "
              f"tolerance {TOLERANCE_ULPS}")
        for i, got in enumerate(results):
            for variant in probe_kernels:
                for key in ("p", "q", "act"):
                    if not np.array_equal(got[variant][key], got["B"][key]):
                        differ = int(np.sum(got[variant][key] != got["B"][key]))
                        wrong.append(f"input {i}: {variant} {key} differs from B's in {differ} values")
            for key, ref in (("p", ref_p[i]), ("q", ref_q[i]), ("act", ref_act[i])):
                err = float(np.max(np.abs(from_bf16_bits(got["B"][key]) - ref)))
                ulps = err / (2.0 ** -8 * float(np.max(np.abs(ref))))
                print(f"  input {i}: B (and the probe) vs the numpy twin, {key}: max |diff| {err:.3g} "
                      f"({ulps:.2f} ulps; max |ref| {float(np.max(np.abs(ref))):.3g})")
                if not err <= tolerance(ref):
                    wrong.append(f"input {i}: B's {key} is {ulps:.2f} ulps from the numpy twin")
            a_values = [from_bf16_bits(got["A"][key]) for key in ("p", "q", "act")]
            if not all(np.all(np.isfinite(v)) for v in a_values):
                wrong.append(f"input {i}: A's outputs are not finite")
        if any(not np.array_equal(a_again[key], results[0]["A"][key]) for key in a_again):
            wrong.append("A replayed on the same input gave other bits")

        # ---- timing: the graphs alternating, rounds of --repeats replays each ------------------
        upload(*inputs[0])
        times = {name: [] for name in graphs}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                times[name].append(replay_us(drv, graph, stream, args.repeats))
        # ---- where a launch's time goes: the one-launch probe once more, eagerly, with warp 0's
        # marks (the .cu's timeline; the same bits and counters, so it is one more replay), on the
        # first input again: its result must be B's of the checks above
        upload(*inputs[0])
        stages = 3 * L
        marks = np.full((ctas, stages, PROBE["TIMELINE_FIELDS"]), TIMELINE_POISON, np.uint64)
        timeline_buf = drv.to_device(marks)
        chain_probe("probe/one", int(timeline_buf))
        stream.synchronize()
        drv.memcpy_dtoh(marks, timeline_buf)
        timeline_buf.free()
        if any(not np.array_equal(download("probe/one")[key], results[0]["B"][key]) for key in ("p", "q", "act")):
            wrong.append("the probe's launch with the timeline gave other bits than B")
        rows, ghz = timeline_summary(marks)
        for name, c in counters.items():   # every replay must leave its counters as the plan says
            left = np.empty(PROBE["COUNTER_STRIDE"] * 3 * L, np.uint32)
            drv.memcpy_dtoh(left, c)
            expect = np.zeros_like(left)
            expect[::PROBE["COUNTER_STRIDE"]] = counters_after_replay(L)
            if not np.array_equal(left, expect):
                wrong.append(f"{name}: counters after the replays {left[::PROBE['COUNTER_STRIDE']].tolist()}, "
                             f"expected {expect[::PROBE['COUNTER_STRIDE']].tolist()}")
        for graph in graphs.values():
            graph.close()

        per_layer = {name: statistics.median(t) / L for name, t in times.items()}
        nbytes = layer_weight_bytes()
        print(f"\nGPU time (median of {args.rounds} rounds of {args.repeats} replays; {L} layers a replay, weights "
              f"{nbytes / 1e6:.1f} MB a layer):")
        print("| variant | µs per layer | µs per step (16 layers) | weights TB/s | vs A, µs a layer (a step) "
              "| vs B, µs a layer (a step) |")
        print("|---|---|---|---|---|---|")
        labels = {"A": "A: engine (residual_norm, prenormed silu_mul)", "B": "B: gemv_bf16 / gemv_silu_mul",
                  "probe/layer": "probe, a launch a layer (PDL)", "probe/one": f"probe, one launch of {L} layers",
                  **{name: f"probe, a launch a layer, {name.split(' ', 1)[1]}" for name in variants}}
        for name, us in per_layer.items():
            deltas = [f"{us - per_layer[base]:+.2f} ({(us - per_layer[base]) * STEP_LAYERS:+.1f})" for base in ("A", "B")]
            print(f"| {labels[name]} | {us:.2f} | {us * STEP_LAYERS:.1f} | {nbytes / us / 1e6:.2f} | "
                  f"{deltas[0]} | {deltas[1]} |")
        spread = {name: (min(t) / L, max(t) / L) for name, t in times.items()}
        print("rounds' range, µs per layer: " + ", ".join(f"{n} {lo:.2f}-{hi:.2f}" for n, (lo, hi) in spread.items()))
        print(f"\none launch of {L} layers with warp 0's marks (the .cu's timeline), µs, median / max over CTAs "
              f"and layers; SM clock {ghz:.2f} GHz from clock64 against %globaltimer:")
        print("| phase | warp 0: start -> pass | pass -> its team's bump | last bump before -> this CTA's pass "
              "| stage: first pass -> last bump |")
        print("|---|---|---|---|---|")
        for row in rows:
            cells = " | ".join(f"{row[key][0]:.2f} / {row[key][1]:.2f}" for key in ("wait", "tile", "handoff", "stage"))
            print(f"| {row['phase']} | {cells} |")
        print(f"total {time.perf_counter() - t_start:.0f} s")
        for buf in (*pools.values(), *(b for v in bufs.values() for b in v.values()), norm_gain, *normed, *row_ss,
                    *counters.values()):
            buf.free()
    if wrong:
        for line in wrong:
            print("WRONG:", line)
        sys.exit(1)


if __name__ == "__main__":
    main()
