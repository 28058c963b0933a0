"""benchmarks/handoff_bench.py's counter chains (CPU only): stub kernels that hand over through
counters must never let a block read before its producer is done, nor hang, across graph
replays — or the benchmark would time a wrong chain. Checked on a model of the GPU's rules,
interleavings drawn at random:
  * a stage's blocks may start (become resident) only once every block of the stage before it has
    started (programmatic dependent launch: allow_consumer is their first instruction);
  * a replay starts only once the replay before it has ended (graph launches in one stream);
  * a block then passes its handoff (griddepcontrol.wait: once every block of the stage before
    has ended; a counter: once it holds the count), block 0 zeroes its reset counter,
    and the block bumps its own counter (stores before the bump: release), in that order.
"""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from tinyvllm.gpu.kernels import kernel_signatures, waits_for_producer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("handoff_bench", ROOT / "benchmarks" / "handoff_bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["handoff_bench"] = bench      # its dataclasses look their module up there
_spec.loader.exec_module(bench)

START, PASSED, RESET, DONE = 1, 2, 3, 4


def simulate(blocks: list[int], replays: int, rng: random.Random) -> None:
    """Run `replays` replays of the chain under a random schedule; assert safety and liveness."""
    plan = bench.counter_plan(blocks)
    counters = [0] * len(blocks)
    for _ in range(replays):
        state = [[0] * n for n in blocks]          # per stage, per block: how far it got
        while not all(s == DONE for stage in state for s in stage):
            moves = []
            for i, stage in enumerate(state):
                for b, s in enumerate(stage):
                    h = plan[i]
                    if s == 0 and (i == 0 or all(x >= START for x in state[i - 1])):
                        moves.append((i, b, START))
                    elif s == START and (counters[h.wait] >= h.wait_count if h.wait is not None
                                         else i == 0 or all(x == DONE for x in state[i - 1])):
                        moves.append((i, b, PASSED))
                    elif s == PASSED:
                        moves.append((i, b, RESET))
                    elif s == RESET:
                        moves.append((i, b, DONE))
            assert moves, f"deadlock: {state} counters {counters}"
            i, b, to = rng.choice(moves)
            h = plan[i]
            if to == PASSED and i > 0:    # safety: every producer block is done
                assert all(s == DONE for s in state[i - 1]), f"stage {i} passed early: {state}"
                assert h.wait is None or counters[h.wait] == blocks[i - 1], "a counter overran its count"
            if to == RESET and b == 0 and h.reset is not None:
                counters[h.reset] = 0
            if to == DONE and h.done is not None:
                counters[h.done] += 1
            state[i][b] = to


@pytest.mark.parametrize("k", [3, 4, 5, 7])
def test_counter_chain_is_safe_and_live_across_replays(k):
    rng = random.Random(k)
    for _ in range(20):
        simulate([rng.randint(1, 4) for _ in range(k)], replays=3, rng=rng)


def test_counter_plan_wiring():
    plan = bench.counter_plan([192, 8, 128, 1024, 128])
    assert [h.wait for h in plan] == [None, 0, 1, 2, None]   # first and last: griddepcontrol.wait
    assert [h.wait_count for h in plan] == [0, 192, 8, 128, 0]
    assert [h.done for h in plan] == [0, 1, 2, None, None]   # nobody polls the last two
    assert [h.reset for h in plan] == [None, None, 0, 1, 2]
    for bad in ([4, 4], [4]):
        with pytest.raises(ValueError):
            bench.counter_plan(bad)


def test_stub_kernel_signature_matches_the_launch():
    source = str(bench.SOURCE)
    # out, in, width, weights, weight_quads, wait_counter, wait_count, done_counter, reset_counter,
    # busy_blocks
    # cluster_chain: buf_a, buf_b, width, stages, weights, weight_quads, pool_quads
    assert kernel_signatures(source) == {bench.KERNEL: "PPiPiPIPPi", "cluster_chain": "PPiiPiQ"}
    assert waits_for_producer(source)


def test_stub_variants_name_its_constants():
    spec = importlib.util.spec_from_file_location("constant_sweep", ROOT / "benchmarks" / "constant_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    source = bench.SOURCE.read_text()
    out = sweep.rewrite_constants(source, {"POLL_PER_BLOCK": 0, "POLL_SLEEP_NS": 0, "POLL_RELAXED": 1})
    assert "constexpr int POLL_PER_BLOCK = 0;" in out and "constexpr int POLL_RELAXED = 1;" in out
