"""The host-overhead machinery: decode batches gathered from BlockManager.tables equal
ForwardBatch.build, text made on demand equals text made every step (in any read order), and
the benchmark runs end to end with its instant fake runner."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.sequence import Sequence


def test_decode_batch_from_the_table_matrix_equals_build():
    rng = np.random.default_rng(0)
    bm = BlockManager(400, block_size=4)
    seqs = []
    for i in range(40):                   # allocate, grow and free in a random order
        seq = Sequence(str(i), None, list(rng.integers(1, 99, rng.integers(1, 30))),
                       SamplingParams(), 0, None)
        bm.allocate(seq)
        for _ in range(int(rng.integers(0, 20))):
            seq.token_ids.append(7)
            bm.append_slot(seq)
        seqs.append(seq)
        if rng.random() < 0.3:
            bm.free(seqs.pop(int(rng.integers(len(seqs)))))
    ctx = [s.num_tokens for s in seqs]
    width = -(-max(ctx) // 4)
    fast = ForwardBatch.build_decode([s.token_ids[-1] for s in seqs], ctx,
                                     bm.tables[[s.block_table_row for s in seqs], :width], 4)
    slow = ForwardBatch.build([[s.token_ids[-1]] for s in seqs], ctx, [s.block_table for s in seqs],
                              4, is_prefill=False)
    for name in ("token_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_tables"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name


@pytest.fixture(scope="module")
def instant_engine(tiny_model_dir):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "engine_overhead.py"
    spec = importlib.util.spec_from_file_location("engine_overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return lambda: LLMEngine(tiny_model_dir, runner=bench.InstantRunner(), device="cpu"), bench


@pytest.mark.parametrize("order", ["streamed", "final only", "backwards"])
def test_text_on_demand_equals_text_every_step(instant_engine, order):
    """Twin requests get the same tokens (the instant runner hashes last token and position);
    a stop string that never occurs (one character: nothing held back) makes one of them
    detokenize every step, the old way. Random ordinary ids split characters now and then."""
    make, _ = instant_engine
    eng = make()
    for r, stop in (("lazy", None), ("eager", "\x00")):
        eng.add_request(r, [1, 2, 3], SamplingParams(max_tokens=300, temperature=0,
                                                     ignore_eos=True, stop=stop))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    lazy = [o.outputs[0] for o in outs if o.request_id == "lazy"]
    eager = [o.outputs[0] for o in outs if o.request_id == "eager"]
    assert [o.token_ids for o in lazy] == [o.token_ids for o in eager]
    reads = {"streamed": lazy, "final only": lazy[-1:], "backwards": lazy[::-1]}[order]
    got = {id(o): (o.delta_text, o.text) for o in reads}
    for lz, eg in zip(lazy, eager):
        if id(lz) in got:
            assert got[id(lz)] == (eg.delta_text, eg.text)
    assert lazy[-1].text == eng.tokenizer.decode(lazy[-1].token_ids)
    assert any("\ufffd" in eng.tokenizer.decode([t]) for t in lazy[-1].token_ids), \
        "meant to include tokens that split a character"


def test_benchmark_runs(instant_engine, tiny_model_dir, monkeypatch):
    _, bench = instant_engine
    monkeypatch.setattr(bench, "MODEL_DIR", tiny_model_dir)
    bench.main(["--workload", "batch64", "--scale", "0.05"])
