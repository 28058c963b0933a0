"""BlockManager: allocation on block boundaries, slots, no leaks, no double frees."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.engine.block_manager import BlockManager, blocks_for
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.sequence import Sequence


class NullDetokenizer:
    def add(self, token_id):
        return ""

    def flush(self):
        return ""


def make_seq(request_id, n_tokens):
    return Sequence(str(request_id), None, list(range(1, n_tokens + 1)), SamplingParams(), 0,
                    NullDetokenizer())


def test_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_covers_prompt_and_append_adds_a_block_at_each_boundary():
    bm = BlockManager(10, block_size=4)
    seq = make_seq("a", 6)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 8
    for n_tokens, blocks in [(7, 2), (8, 2), (9, 3), (10, 3), (11, 3), (12, 3), (13, 4)]:
        seq.token_ids.append(0)
        assert seq.num_tokens == n_tokens
        bm.append_slot(seq)
        assert len(seq.block_table) == blocks
    assert bm.num_free_blocks == 6
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == [] and seq.num_cached_tokens == 0


def test_slots_follow_the_block_table():
    bm = BlockManager(8, block_size=4)
    first, second = make_seq("a", 3), make_seq("b", 6)
    bm.allocate(first)
    bm.allocate(second)
    assert second.block_table == [1, 2]
    assert [bm.slot(second, p) for p in range(6)] == [4, 5, 6, 7, 8, 9]


def test_can_allocate_and_can_append_respect_the_free_list():
    bm = BlockManager(3, block_size=4)
    big = make_seq("big", 12)
    assert bm.can_allocate(big) and not bm.can_allocate(make_seq("huge", 13))
    bm.allocate(big)
    assert not bm.can_allocate(make_seq("c", 1))
    big.token_ids.append(0)              # 13th token starts a 4th block
    assert not bm.can_append(big)
    with pytest.raises(RuntimeError):
        bm.append_slot(big)


def test_double_free_and_foreign_free_are_caught():
    bm = BlockManager(4, block_size=4)
    a = make_seq("a", 4)
    bm.allocate(a)
    impostor = make_seq("b", 4)
    impostor.block_table = list(a.block_table)
    with pytest.raises(RuntimeError, match="does not own"):
        bm.free(impostor)


def test_many_random_sequences_never_leak():
    rng = np.random.default_rng(0)
    bm = BlockManager(64, block_size=8)
    live = []
    for i in range(2000):
        if live and (rng.random() < 0.4 or not bm.can_allocate(make_seq("x", 30))):
            bm.free(live.pop(rng.integers(len(live))))
        seq = make_seq(i, int(rng.integers(1, 30)))
        if bm.can_allocate(seq):
            bm.allocate(seq)
            live.append(seq)
        for s in live:
            if rng.random() < 0.5:
                s.token_ids.append(0)
                if bm.can_append(s):
                    bm.append_slot(s)
                else:
                    s.token_ids.pop()
        owned = [b for s in live for b in s.block_table]
        assert len(owned) == len(set(owned)) and len(owned) + bm.num_free_blocks == 64
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == 64 and sorted(bm._free) == list(range(64))
