"""Structured outputs under async scheduling (engine/step_ahead.py, structured/mask.py's
PendingTokenMask), on the numpy backend: a step holding constrained rows goes ahead like a plain
decode step, its mask made only once the step before is applied. Whatever goes ahead, every
step() call reports what it reports without async scheduling — greedy and seeded constrained
rows, rows whose grammar completes (or that are aborted) while the next step is already
launched, plain rows beside them — and each pending mask is made after its rows' last tokens
are in (their matchers advanced), never for a row that finished meanwhile."""
from __future__ import annotations

import numpy as np
import pytest
from test_async_scheduling import prompts, snapshot

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.reference.numpy_runner import NumpyRunner
from tinyvllm.structured import StructuredOutputsParams as SO
from tinyvllm.structured.mask import PendingTokenMask, TokenMask

OPTIONS = dict(device="cpu", block_size=4, max_num_seqs=8, max_model_len=160)
RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["alpha", "beta"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3}},
    "required": ["id", "kind", "tags"], "additionalProperties": False}


def requests():
    p = prompts(6, seed=11)
    so = lambda **kw: dict(structured_outputs=SO(**kw))  # noqa: E731
    return [
        ("greedy-json", p[0], SamplingParams(temperature=0, max_tokens=70, **so(json=RECORD))),
        ("seeded-json", p[1], SamplingParams(temperature=1.0, seed=5, max_tokens=70, **so(json=RECORD))),
        ("choice", p[2], SamplingParams(temperature=0.8, seed=6, max_tokens=30, **so(choice=["yes", "no"]))),
        ("regex", p[3], SamplingParams(temperature=0, max_tokens=30, **so(regex="[a-c]{3,9}!"))),
        ("aborted", p[4], SamplingParams(temperature=0.9, seed=7, max_tokens=70, **so(json=RECORD))),
        ("plain", p[5], SamplingParams(temperature=0.7, seed=8, max_tokens=24, ignore_eos=True)),
    ]


def run(model_dir, async_scheduling: bool, abort_at: int = 6):
    """-> (the snapshots of each step() call's outputs, the engine). After every call, a step
    launched ahead has its mask made already (the engine resolves it once the step before is
    applied)."""
    engine = LLMEngine(model_dir, **OPTIONS, async_scheduling=async_scheduling)
    for r in requests():
        engine.add_request(*r)
    calls = []
    while engine.has_unfinished_requests():
        if len(calls) == abort_at:
            engine.abort_request("aborted")
        calls.append([snapshot(o) for o in engine.step()])
        mask = engine.step_ahead.launched_mask
        assert mask is None or mask.resolved, "the step launched ahead left its mask unmade"
        assert len(calls) < 300
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    return calls, engine


@pytest.fixture
def launches(monkeypatch):
    """Every step NumpyRunner launches with a pending mask: (the launched batch, the rows'
    sequences, the mask it resolved to), its mask unmade at launch. Each is checked as it
    resolves: every row still
    running has its last token appended (the step's context ends with it, its matcher advanced
    with it); the mask's rows are exactly the constrained rows still running."""
    seen = []

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch):
        pending = sampling.token_mask
        if isinstance(pending, PendingTokenMask):
            assert batch.fed_rows is not None, "only a step launched ahead has a pending mask"
            assert not pending.resolved, "launched before its mask is made"
            entry = [batch, list(pending.seqs), None]
            seen.append(entry)

            def check(mask):
                live = [i for i, s in enumerate(entry[1]) if not s.status.is_finished]
                for i in live:
                    assert len(entry[1][i].token_ids) == batch.context_lens[i], "mask made before the token"
                constrained = [i for i in live if entry[1][i].constraint is not None]
                assert (mask.rows.tolist() if mask is not None else []) == constrained
                entry[2] = mask
            pending.on_resolved(check)
        return ModelRunner.launch(self, batch, sampling)
    monkeypatch.setattr(NumpyRunner, "launch", launch)
    return seen


def test_constrained_steps_go_ahead_with_the_sync_outputs(tiny_model_dir, launches):
    sync_calls, _ = run(tiny_model_dir, async_scheduling=False)
    assert not launches
    async_calls, engine = run(tiny_model_dir, async_scheduling=True)
    assert async_calls == sync_calls
    finals = {o[0]: o[2][0] for call in sync_calls for o in call if o[1]}
    assert finals["aborted"][4] == "abort" and finals["plain"][4] == "length"
    assert finals["choice"][4] == "stop" and finals["choice"][2] in ("yes", "no")
    constrained_calls = sum(any(o[0] != "plain" for o in call) for call in sync_calls)
    assert len(launches) >= constrained_calls - 1, "the constrained decode steps went ahead"
    assert engine.step_ahead.num_launched >= len(sync_calls) - 2     # all but the tail
    assert all(entry[2] is not None or all(s.constraint is None or s.status.is_finished for s in entry[1])
               for entry in launches)
    # rows whose grammar completed (or that were aborted) while their next step was in flight
    assert engine.step_ahead.num_rows_thrown_away >= 2
    print(f"{len(launches)} constrained steps ahead of {len(sync_calls)} calls, "
          f"{engine.step_ahead.num_rows_thrown_away} rows thrown away")


def test_a_finished_row_is_left_out_of_the_pending_mask(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, **OPTIONS)
    for r in requests()[:4]:
        engine.add_request(*r)
    engine.step()                                        # the prefill: every matcher has a token
    seqs = [engine._requests[name].seqs[0] for name in ("greedy-json", "choice", "regex")]
    engine.abort_request("choice")
    pending = PendingTokenMask(seqs)
    mask = pending.resolve()
    assert mask.rows.tolist() == [0, 2] and pending.resolved
    assert pending.resolve() is mask, "resolved once"
    got = []
    pending.on_resolved(got.append)
    assert got == [mask]


class MaskEcho(ModelRunner):
    """Samples, in each row, the lowest token its mask allows (0 where unmasked), and records
    the masks execute() was given."""
    num_kv_blocks = 8

    def __init__(self):
        self.masks = []

    def execute(self, batch, sampling):
        self.masks.append(sampling.token_mask)
        ids = np.zeros(batch.num_seqs, np.int32)
        if sampling.token_mask is not None:
            bits = sampling.token_mask.bits.view(np.uint32)
            for j, row in enumerate(sampling.token_mask.rows):
                allowed = np.flatnonzero((bits[j][:, None] >> np.arange(32, dtype=np.uint32)) & 1)
                ids[row] = allowed[0]
        return ids


class FixedMask(PendingTokenMask):
    """A pending mask whose rows and bits are given, counting its resolutions."""

    def __init__(self, mask):
        super().__init__([])
        self.fixed, self.made = mask, 0

    def resolve(self):
        if not self.resolved:
            self.made += 1
            self._mask = self.fixed
            callbacks, self._callbacks = self._callbacks, None
            for callback in callbacks:
                callback(self._mask)
        return self._mask


def test_the_default_launch_resolves_the_mask_when_the_step_samples():
    """ModelRunner.launch's twin: nothing runs at launch; the step's execute gets the resolved
    TokenMask, made once, whether the step is waited for or the step fed from it is."""
    runner = MaskEcho()
    tables = np.zeros((2, 1), np.int32)
    bits = np.zeros((1, 2), np.int32)
    bits[0, 1] = 1 << 5                                   # token 37 only
    pending = FixedMask(TokenMask(np.asarray([1], np.int32), bits))
    sampling = SamplingBatch.greedy(2)
    sampling.token_mask = pending
    first = runner.launch(ForwardBatch.build_decode([1, 2], [1, 1], tables, 4), sampling)
    fed = ForwardBatch.build_decode([0, 0], [2, 2], tables, 4)
    fed.fed_rows = np.asarray([0, 1], np.int32)
    second = runner.launch(fed, SamplingBatch.greedy(2))
    assert pending.made == 0 and not runner.masks, "launch runs nothing"
    assert second.wait().tolist() == [0, 0]
    assert pending.made == 1 and runner.masks[0] is pending.fixed and runner.masks[1] is None
    assert first.wait().tolist() == [0, 37] and pending.made == 1
