"""gpu/handoff.py's counter chains (CPU only): kernels that hand over through counters
(TINYVLLM_HANDOFF=counter) must never let a block read before its producer is done, nor hang,
across steps and graph replays. Checked on a model of the GPU's rules, interleavings drawn at
random:
  * a stage's blocks may start (become resident) only once every block of the stage before it has
    started (programmatic dependent launch: allow_consumer is their first instruction);
  * a pass starts only once the pass before it has ended (graph launches, or a step's chain
    behind the LM head and sampler, which wait with griddepcontrol.wait);
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

from tinyvllm.gpu.handoff import NO_HANDOFF, HandoffChain, counter_plan, stage_handoff
from tinyvllm.gpu.kernels import kernel_signatures, waits_for_producer

ROOT = Path(__file__).resolve().parents[1]

START, PASSED, RESET, DONE = 1, 2, 3, 4


def simulate(blocks: list[int], replays: int, rng: random.Random) -> None:
    """Run `replays` replays of the chain under a random schedule; assert safety and liveness."""
    plan = counter_plan(blocks)
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
    plan = counter_plan([192, 8, 128, 1024, 128])
    assert [h.wait for h in plan] == [None, 0, 1, 2, None]   # first and last: griddepcontrol.wait
    assert [h.wait_count for h in plan] == [0, 192, 8, 128, 0]
    assert [h.done for h in plan] == [0, 1, 2, None, None]   # nobody polls the last two
    assert [h.reset for h in plan] == [None, None, 0, 1, 2]
    for bad in ([4, 4], [4]):
        with pytest.raises(ValueError):
            counter_plan(bad)
    with pytest.raises(ValueError):
        stage_handoff(5, 5, 1)


def test_chain_gives_each_launch_its_pointers():
    base = 0x7000_0000
    chain = HandoffChain(base, 5)
    got = [chain.args(blocks) for blocks in (192, 8, 128, 1024, 128)]
    assert chain.finished
    at = lambda i: base + 4 * i   # noqa: E731
    assert got == [(0, 0, at(0), 0), (at(0), 192, at(1), 0), (at(1), 8, at(2), at(0)),
                   (at(2), 128, 0, at(1)), (0, 0, 0, at(2))]
    assert NO_HANDOFF == (0, 0, 0, 0)


def test_stub_kernel_signature_matches_the_launch():
    spec = importlib.util.spec_from_file_location("handoff_bench", ROOT / "benchmarks" / "handoff_bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["handoff_bench"] = bench      # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    source = str(bench.SOURCE)
    # out, in, width, weights, weight_quads, wait_counter, wait_count, done_counter, reset_counter,
    # busy_blocks
    assert kernel_signatures(source) == {bench.KERNEL: "PPiPiPIPPi"}
    assert waits_for_producer(source)


def test_handoff_setting_is_checked(monkeypatch):
    from tinyvllm.gpu.ops import GpuOps
    monkeypatch.setenv("TINYVLLM_HANDOFF", "flags")
    with pytest.raises(ValueError, match="TINYVLLM_HANDOFF must be one of"):
        GpuOps(None, num_sms=132)
    monkeypatch.setenv("TINYVLLM_HANDOFF", "counter")
    monkeypatch.setenv("TINYVLLM_FUSE_NORM", "auto")
    with pytest.raises(ValueError, match="handed-over norms"):
        GpuOps(None, num_sms=132)
    monkeypatch.setenv("TINYVLLM_FUSE_NORM", "producer")
    ops = GpuOps(None, num_sms=132)
    assert isinstance(ops.counter_chain(0x1000, 10), HandoffChain)
    ops.skip_ops = frozenset({"sample_tokens"})     # decode_profile's leave-one-out: no chain survives it
    assert ops.counter_chain(0x1000, 10) is None


def test_model_chains_the_fused_layers(tiny_model_dir, monkeypatch):
    """With TINYVLLM_HANDOFF=counter a decode step's five launches per layer carry the chain's
    arguments in order (each GEMV's and the attention's last four), and nothing else does: the
    embedding before and the LM head after keep griddepcontrol.wait; without the setting, nothing.
    Driven through the real LlamaModel.forward and GpuOps launchers, the device replaced by
    address arithmetic (test_trace's fake runner)."""
    from fake_device import FakeCudaRunner

    from tinyvllm.config import EngineConfig, ModelConfig
    from tinyvllm.gpu.model import StepShape
    monkeypatch.setenv("TINYVLLM_HANDOFF", "counter")
    config = ModelConfig.from_pretrained(tiny_model_dir)
    fake = FakeCudaRunner(config, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256))
    launches = []

    class Recording:
        def function(self, name):
            return type("Fn", (), {"launch": lambda _self, grid, block, stream, args, *rest, **kw:
                                   launches.append((name, grid, tuple(args))),
                                   "max_dynamic_shared_bytes": 1 << 20})()
    fake.ops.library = Recording()
    fake.model.forward(StepShape(num_tokens=2, num_seqs=2, is_prefill=False))
    layer_launches = [(name, grid, args) for name, grid, args in launches
                      if name.startswith(("gemv_", "attention_decode")) and name != "gemv_prenormed_bf16"]
    stages = 5 * config.num_hidden_layers
    assert len(layer_launches) == stages
    expected = HandoffChain(int(fake.arena.view("handoff_counters")), stages)
    for name, grid, args in layer_launches:
        assert args[-4:] == expected.args(grid[0] * grid[1] * grid[2]), name
    others = [(name, args) for name, grid, args in launches if (name, grid, args) not in layer_launches]
    assert [name for name, _ in others] == ["embedding_gather", "gemv_prenormed_bf16"]
    assert others[1][1][-4:] == NO_HANDOFF            # the LM head

    launches.clear()
    fake.ops.handoff = "pdl"          # the default: the same launches, no chain
    fake.model.forward(StepShape(num_tokens=2, num_seqs=2, is_prefill=False))
    chainable = [args for name, _, args in launches if name.startswith(("gemv_", "attention_decode"))]
    assert len(chainable) == stages + 1 and all(args[-4:] == NO_HANDOFF for args in chainable)
