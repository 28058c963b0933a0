"""benchmarks/persistent_mlp_probe.py and its kernel, on the CPU: the facts the benchmark launches
with must be the kernel's, its tiles must cover every output once, its shared memory and
registers must leave one CTA per SM (the counters' spins need every CTA resident), the counter
plan must neither let a stage read early nor hang across graph replays, and the numpy twin the
GPU result is checked against must compute the chain. No GPU is needed; the GPU run itself is
the benchmark (it checks its own results and prints WRONG).
"""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.gpu.kernels import kernel_constants, kernel_parameters, kernel_signatures, waits_for_producer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("persistent_mlp_probe", ROOT / "benchmarks" / "persistent_mlp_probe.py")
probe = importlib.util.module_from_spec(_spec)
sys.modules["persistent_mlp_probe"] = probe      # its dataclasses look their module up there
_spec.loader.exec_module(probe)

C = probe.PROBE
GEMV = kernel_constants("gemv.cu")
SM_COUNTS = (132, 128, 114, 100, 1)   # H100 SXM / H200, exactly the tile count, H100 PCIe, fewer


def test_kernel_parameters_are_the_launch():
    source = str(probe.SOURCE)
    # chain_probe passes (p, q, act, w_o, w_gu, w_d, layers, counters, reset_counter, timeline)
    names = [decl.split()[-1].lstrip("*") for decl in kernel_parameters(source)[probe.KERNEL]]
    assert names == ["p", "q", "act", "w_o", "w_gu", "w_d", "layers", "counters", "reset_counter", "timeline"]
    assert kernel_signatures(source) == {probe.KERNEL: "PPPPPPiPPP"}
    assert waits_for_producer(source)     # griddepcontrol.wait: PDL launches are allowed


def test_constants_are_the_engines():
    from tinyvllm.gpu.ops import GpuOps
    ops = GpuOps(None, num_sms=132)        # the launch rules only: no library, no GPU
    shapes = {ph.name: ph for ph in probe.phases()}
    for name, n, k in (("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)):
        assert (shapes[name].rows, shapes[name].k) == (n, k)
        assert shapes[name].k_warps == ops.decode_k_warps(name, n, k), name   # B and the probe: the engine's splits
    # the same tile, step and ring depth as gemv.cu, so a warp has as many bytes in flight
    assert (C["TILE_ROWS"], C["STEP_K"], C["RING_STEPS"]) == (GEMV["ROWS_PER_CTA"], GEMV["STEP_K"], GEMV["RING_STEPS"])
    assert C["THREADS"] == 32 * C["WARPS"] == 32 * GEMV["MAX_K_WARPS"]
    assert C["COUNTER_STRIDE"] * 4 == 128   # one L2 line per counter (session 14: packed counters contend)


def test_shared_memory_and_registers_leave_one_cta_per_sm():
    assert probe.shared_bytes() == C["SHARED_BYTES"]
    sm_shared, cta_limit = 233_472, 227 * 1024   # sm_90: per SM, per CTA opt-in (1 KB per CTA reserved)
    assert C["SHARED_BYTES"] + 16 <= cta_limit <= sm_shared - 1024   # + `ready` and its alignment
    # __launch_bounds__(THREADS, 1) caps a thread at 65,536 / THREADS registers: one CTA fits the file
    assert C["THREADS"] * (65_536 // C["THREADS"]) <= 65_536 and 65_536 // C["THREADS"] == 64
    source = probe.SOURCE.read_text()
    assert "__launch_bounds__(THREADS, 1)" in source
    # a ring's W bytes per warp equal the engine's ring (RING_STEPS steps of 2 rows x 32 lanes x 16 B)
    assert C["RING_BYTES_PER_WARP"] >= C["RING_STEPS"] * 2 * 32 * 16


def test_named_barriers_are_distinct_and_whole_warps():
    ids = []
    for ph in probe.phases():
        assert C["WARPS"] % ph.k_warps == 0
        ids += [ph.barrier + team for team in range(ph.teams)]
        assert (32 * ph.k_warps) % 32 == 0 and 32 * ph.k_warps <= C["THREADS"]
    assert len(ids) == len(set(ids)) and min(ids) >= 1 and max(ids) <= 15   # 0 is __syncthreads


@pytest.mark.parametrize("ctas", SM_COUNTS)
def test_tiles_cover_every_output_exactly_once(ctas):
    for ph in probe.phases():
        seen = []
        for cta in range(ctas):
            owned = [probe.team_tiles(ph, cta, team, ctas) for team in range(ph.teams)]
            any_tile = any(owned)
            assert bool(owned[0]) == any_tile, "warp 0 (team 0) polls for its CTA: it must have a tile if any warp has"
            seen += [tile for tiles in owned for tile in tiles]
        assert sorted(seen) == list(range(ph.tiles)), ph.name
        assert probe.team_tiles(ph, 0, 0, ctas)[:1] == [0], "CTA 0 resets the counters: it has a tile in every phase"
        rows = [row for tile in range(ph.tiles) for row in probe.tile_rows(ph, tile)]
        assert sorted(rows) == list(range(ph.rows)), ph.name   # every W row (output) once
        if ctas >= 128:   # the H100's and H200's 132: no team runs two tiles, so no round waits on another
            assert all(len(probe.team_tiles(ph, c, t, ctas)) <= 1 for c in range(ctas) for t in range(ph.teams))


def test_gate_up_tiles_pair_gate_and_up_rows():
    ph = next(p for p in probe.phases() if p.name == "gate_up")
    inter = ph.rows // 2
    for tile in (0, 1, ph.tiles - 1):
        rows = probe.tile_rows(ph, tile)
        assert [r + inter for r in rows[:8]] == rows[8:]   # column c's partner is column c ^ 8


def test_warp_steps_split_k_in_order():
    for ph in probe.phases():
        walked = [s for member in range(ph.k_warps) for s in probe.warp_steps(ph, member)]
        assert walked == list(range(ph.steps)), ph.name
    o = next(p for p in probe.phases() if p.name == "o")
    # o's whole weight goes into the ring before the wait: its warps walk exactly RING_STEPS steps
    assert all(len(probe.warp_steps(o, m)) == C["RING_STEPS"] for m in range(o.k_warps))


# ---- the counter plan on a model of the kernel and the launch rules (as test_handoff_bench.py) ---
def simulate(layers: int, one_launch: bool, tiles: list[int], ctas: int, replays: int, rng: random.Random) -> None:
    """Replays of a probe chain under random schedules, modelled as the kernel runs it. Tile i of
    a phase belongs to CTA i % ctas. Stage s = 3 * layer + phase of a launch: the CTA's poller
    (warp 0, with the CTA's first tile) passes the stages its CTA has tiles in, in order; it
    passes stage s once the launch before has completed (griddepcontrol.wait, which every wait
    executes) and, for s > 0, the launch's counter s - 1 holds stage s - 1's tile count; CTA 0's
    pass zeroes counter s - 2 (s == 0: the launch's reset counter). After its pass every tile of
    the CTA in stage s may finish (the other warps read the pass from shared memory), bumping
    counter s unless s is the launch's last stage, and the poller goes on once its own tile is
    done (the other warps may still be at it). The next replay starts when this one has ended.
    Asserts: no stage passes before the stage before it is done everywhere (nor a launch's first
    before the launch before it), no counter passes its count, no schedule deadlocks, and every
    replay leaves the counters as counters_after_replay says (with the model's tile counts)."""
    plan = probe.counter_plan(layers, one_launch)
    counters = [0] * (3 * layers)
    left = [0] * (3 * layers)
    left[3 * layers - 2] = tiles[1]
    owned = {(s, c): [i for i in range(tiles[s % 3]) if i % ctas == c] for s in range(3 * layers) for c in range(ctas)}
    for _ in range(replays):
        done = set()        # (launch, stage, tile)
        passed = set()      # (launch, stage, cta): the CTA's poller passed the stage's wait
        stages = {(j, c): [s for s in range(3 * launch.layers) if owned[launch.first_layer * 3 + s, c]]
                  for j, launch in enumerate(plan) for c in range(ctas)}
        at = {key: 0 for key in stages}          # the poller's place in its CTA's stages
        total = sum(tiles[s % 3] for launch in plan for s in range(3 * launch.layers))

        def launch_done(j: int) -> bool:
            return j < 0 or all((j, s, i) in done for s in range(3 * plan[j].layers) for i in range(tiles[s % 3]))

        while len(done) < total:
            moves = []
            for (j, c), mine in stages.items():
                if at[j, c] == len(mine):
                    continue
                s = mine[at[j, c]]
                if (j, s, c) not in passed:
                    counter_ok = s == 0 or counters[plan[j].counters + s - 1] >= tiles[(s - 1) % 3]
                    if launch_done(j - 1) and counter_ok:
                        moves.append(("pass", j, s, c))
                elif (j, s, owned[s, c][0]) in done:
                    moves.append(("next", j, s, c))
            moves += [("done", j, s, i) for (j, s, c) in passed for i in owned[s, c] if (j, s, i) not in done]
            assert moves, f"deadlock: counters {counters}"
            what, j, s, x = rng.choice(moves)
            launch = plan[j]
            if what == "pass":
                if s > 0:   # safety: the whole stage before is done, and its counter says exactly that
                    assert all((j, s - 1, i) in done for i in range(tiles[(s - 1) % 3])), (j, s, x)
                    assert counters[launch.counters + s - 1] == tiles[(s - 1) % 3]
                assert launch_done(j - 1)
                if x == 0:
                    stale = launch.counters + s - 2 if s >= 2 else launch.reset if s == 0 else None
                    if stale is not None:
                        counters[stale] = 0
                passed.add((j, s, x))
            elif what == "next":
                at[j, x] += 1
            else:
                if s + 1 < 3 * launch.layers:
                    counters[launch.counters + s] += 1
                done.add((j, s, x))
        assert counters == left, f"a replay left counters {counters}"


@pytest.mark.parametrize("layers", [1, 2, 3, 5])
@pytest.mark.parametrize("one_launch", [False, True])
def test_counter_plan_is_safe_and_live_across_replays(layers, one_launch):
    rng = random.Random(layers * 2 + one_launch)
    for _ in range(10):
        ctas = rng.randint(1, 4)
        # as the real shapes (test_phase_tile_counts_keep_the_pollers_in_order): o and down the
        # same count, gate_up at least as many
        rows = rng.randint(1, 2 * ctas)
        simulate(layers, one_launch, [rows, rng.randint(rows, 3 * ctas), rows], ctas, replays=3, rng=rng)


def test_phase_tile_counts_keep_the_pollers_in_order():
    """The counter the last down polls is zeroed only by the next replay's first stage, so its
    pollers must reach it through an earlier stage of the same replay, never poll it first:
    every CTA with a down tile has o and gate_up tiles too (tile i is CTA i % SMs)."""
    o, gate_up, down = probe.phases()
    assert o.tiles == down.tiles <= gate_up.tiles


def test_counters_after_replay():
    left = probe.counters_after_replay(3)
    assert left.tolist() == [0] * 7 + [2 * C["INTERMEDIATE"] // C["TILE_ROWS"], 0]


def test_counter_plan_wiring():
    assert probe.counter_plan(4, one_launch=True) == [probe.Launch(0, 4, 0, 10)]
    per_layer = probe.counter_plan(3, one_launch=False)
    assert [(x.first_layer, x.layers, x.counters, x.reset) for x in per_layer] == [(0, 1, 0, 7), (1, 1, 3, 1),
                                                                                  (2, 1, 6, 4)]
    with pytest.raises(ValueError):
        probe.counter_plan(0, one_launch=True)


# ---- the numpy twin ---------------------------------------------------------------------------
def test_bf16_rounding_is_nearest_even():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 100,
                             # exact ties: bf16 value + half an ulp, both parities
                             probe.from_bf16_bits(np.arange(0x3F80, 0x3F90, dtype=np.uint16))
                             * np.float32(1 + 2.0 ** -8),
                             np.array([0.0, -0.0, np.inf, -np.inf, 1e-40], np.float32)])
    expect = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(probe.to_bf16_bits(values), expect)
    assert np.array_equal(probe.from_bf16_bits(expect), values.astype(ml_dtypes.bfloat16).astype(np.float32))


def naive_chain(p, q, layers):
    """The chain written out value by value in float64, rounding to bf16 where the GPU stores."""
    rnd = lambda x: float(probe.bf16_round(np.float32(x)))  # noqa: E731
    p, q = [float(v) for v in p], [float(v) for v in q]
    act = []
    for w_o, w_gu, w_d in layers:
        w_o, w_gu, w_d = (probe.from_bf16_bits(w).astype(np.float64) for w in (w_o, w_gu, w_d))
        q = [rnd(q[i] + sum(w_o[i, k] * p[k] for k in range(len(p)))) for i in range(len(q))]
        half = w_gu.shape[0] // 2
        gu = [rnd(sum(w_gu[i, k] * q[k] for k in range(len(q)))) for i in range(2 * half)]
        act = [rnd(g / (1 + np.exp(-g)) * u) for g, u in zip(gu[:half], gu[half:])]
        p = [rnd(p[i] + sum(w_d[i, k] * act[k] for k in range(half))) for i in range(len(p))]
    return np.array(p), np.array(q), np.array(act)


def test_reference_chain_is_the_chain():
    rng = np.random.default_rng(2)
    hidden, inter = 16, 24
    layers = [(probe.random_bf16_bits(rng, (hidden, hidden), -3), probe.random_bf16_bits(rng, (2 * inter, hidden), -3),
               probe.random_bf16_bits(rng, (hidden, inter), -3)) for _ in range(3)]
    p0 = np.concatenate([probe.random_stream(rng, hidden) for _ in range(2)])
    q0 = np.concatenate([probe.random_stream(rng, hidden) for _ in range(2)])
    p, q, act = probe.reference_chain(p0, q0, layers)
    assert p.dtype == q.dtype == act.dtype == np.float32 and act.shape == (2, inter)
    for row in range(2):   # rows are independent inputs, each the naive chain up to bf16 rounding flips
        for got, want in zip((p[row], q[row], act[row]), naive_chain(p0[row], q0[row], layers)):
            assert np.max(np.abs(got - want)) <= probe.tolerance(want)
            assert np.array_equal(got, probe.bf16_round(got))   # every stored value is a bf16 value


def test_reference_chain_reads_gate_rows_first_and_adds_residuals():
    rng = np.random.default_rng(3)
    hidden, inter = 8, 8
    zeros = lambda shape: np.zeros(shape, np.uint16)  # noqa: E731 — bf16 +0
    w_gu = probe.random_bf16_bits(rng, (2 * inter, hidden), -2)
    w_gu[inter:] = 0                                  # up rows zero: act = silu(gate) * 0 = 0
    p0, q0 = probe.random_stream(rng, hidden), probe.random_stream(rng, hidden)
    p, q, act = probe.reference_chain(p0, q0, [(zeros((hidden, hidden)), w_gu, probe.random_bf16_bits(rng, (hidden, inter), -2))])
    assert np.array_equal(q, q0) and np.array_equal(p, p0) and not np.any(act)
    w_gu = probe.random_bf16_bits(rng, (2 * inter, hidden), -2)
    w_gu[:inter] = 0                                  # gate rows zero: silu(0) = 0
    _, _, act = probe.reference_chain(p0, q0, [(zeros((hidden, hidden)), w_gu, zeros((hidden, inter)))])
    assert not np.any(act)


def test_tolerance_is_a_few_ulps_of_the_largest_value():
    ref = np.array([0.5, -3.0, 1.0], np.float32)
    assert probe.tolerance(ref) == probe.TOLERANCE_ULPS * 3.0 / 256


def test_help_runs_without_a_gpu():
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "persistent_mlp_probe.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--layers" in out.stdout and "--repeats" in out.stdout


def test_timeline_summary_reads_the_marks():
    """A made-up timeline with known durations: 2 CTAs, 2 layers, the SM clock at 2 GHz; CTA 1 has
    no o tile (poisoned stages), as CTAs 128-131 of a 132-SM GPU."""
    ctas, layers, fields = 2, 2, C["TIMELINE_FIELDS"]
    assert fields == 5
    marks = np.full((ctas, 3 * layers, fields), probe.TIMELINE_POISON, np.uint64)
    ns = 10_000                              # %globaltimer at the first pass
    wait_us = {"o": 1.0, "gate_up": 2.0, "down": 3.0}
    tile_us = {"o": 4.0, "gate_up": 20.0, "down": 10.0}
    for stage in range(3 * layers):
        name = ("o", "gate_up", "down")[stage % 3]
        for cta in range(ctas):
            if name == "o" and cta == 1:
                continue
            late = 500 * cta                   # CTA 1 passes 0.5 µs after CTA 0
            passed = ns + late
            cycles = 2 * passed                # clock64 at 2 GHz, from the same origin
            marks[cta, stage] = [cycles - 2 * 1000 * wait_us[name], cycles, cycles + 2 * 1000 * tile_us[name],
                                 passed, passed + 1000 * tile_us[name]]
        ns += 1000 * tile_us[name] + 500 + 700   # CTA 1's lateness, then a 0.7 µs hand-over
    rows, ghz = probe.timeline_summary(marks)
    assert ghz == pytest.approx(2.0)
    by_phase = {row["phase"]: row for row in rows}
    for name in ("o", "gate_up", "down"):
        assert by_phase[name]["wait"] == pytest.approx((wait_us[name], wait_us[name]))
        assert by_phase[name]["tile"] == pytest.approx((tile_us[name], tile_us[name]))
    # the stage before's last bump -> each CTA's pass: CTA 1 bumps and passes 0.5 µs after CTA 0
    assert by_phase["down"]["handoff"] == pytest.approx((0.95, 1.2))      # 0.7 and 1.2 after CTA 1's bump
    assert by_phase["gate_up"]["handoff"] == pytest.approx((1.45, 1.7))   # o's last bump is CTA 0's, 0.5 earlier
    assert by_phase["o"]["handoff"] == pytest.approx((0.7, 0.7))          # layer 1's o: CTA 0 alone passes
    assert by_phase["gate_up"]["stage"] == pytest.approx((20.5, 20.5))
    with pytest.raises(ValueError):
        probe.timeline_summary(marks[:, :, :4])


def test_variants_rewrite_only_the_switches(tmp_path, monkeypatch):
    """--variant rewrites the .cu's switches (constant_sweep's rewriting) and refuses the constants
    the host reads as launch facts: a rewritten RING_STEPS would change SHARED_BYTES under it."""
    spec = importlib.util.spec_from_file_location("constant_sweep", ROOT / "benchmarks" / "constant_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "constant_sweep", sweep)   # the probe imports it by name (run from benchmarks/)
    spec.loader.exec_module(sweep)
    values = probe.variant_constants("POLLER_WAITS_FIRST=1,WIDE_L2=0,POLL_SLEEP_NS=20")
    assert values == {"POLLER_WAITS_FIRST": 1, "WIDE_L2": 0, "POLL_SLEEP_NS": 20}
    assert all(name in C for name in probe.VARIANT_SWITCHES)    # each one a constant of the .cu
    rewritten = tmp_path / "persistent_mlp_probe.cu"
    rewritten.write_text(sweep.rewrite_constants(probe.SOURCE.read_text(), values))
    after = kernel_constants(str(rewritten))
    assert {name: after[name] for name in values} == values
    assert {k: v for k, v in after.items() if k not in values} == {k: v for k, v in C.items() if k not in values}
    for bad in ("RING_STEPS=2", "SHARED_BYTES=1", "POLLER_WAITS_FIRST=one"):
        with pytest.raises(ValueError):
            probe.variant_constants(bad)
