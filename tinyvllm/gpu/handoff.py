"""Kernel boundaries by counter: the decode layers' kernels hand over through counters in global
memory instead of griddepcontrol.wait (TINYVLLM_HANDOFF=counter; off by default, under test).

Every decode kernel runs under programmatic dependent launch (gpu/kernels.py): it is resident
before the kernel it depends on has finished, and its griddepcontrol.wait returns once that whole
grid has completed and its writes are flushed. A counter can say the same thing sooner: each
block of the producer, its stores done, bumps the producer's counter (a release), and the
consumer's warps poll it (acquire) until it holds the producer's block count (common.cuh's
handoff_wait / handoff_done). benchmarks/handoff_bench.py measures the two on stub chains.

A chain is K kernels in stream order, each needing all of the one before. Stage i's handoff
(`stage_handoff`):
  * the first and the last stage wait with griddepcontrol.wait; stage i in between polls counter
    i - 1 until it holds the block count of stage i - 1;
  * stage i bumps counter i (once per block, at its end) when stage i + 1 polls it;
  * block 0 of stage i + 2 zeroes counter i once past its own handoff: every block of stage
    i + 1 had polled counter i before it bumped counter i + 1 (or, for the last stage, before
    its grid completed), so nobody reads counter i again in this pass, and the next pass finds
    it at zero. The last stage waits with griddepcontrol.wait because the counter it would poll
    could otherwise be zeroed only by the next pass's first stage, and under PDL the next pass's
    later stages may poll before that stage runs (tests/test_handoff.py's model of the GPU's
    rules finds that schedule).
Counters start at zero (the arena is zeroed when allocated) and a full pass leaves them at zero,
so a pass may be an eager step or a graph replay, and any number of graphs may share them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Handoff:
    """How one stage waits and signals: counter indices (None: not used). wait None means
    griddepcontrol.wait."""
    wait: int | None
    wait_count: int
    done: int | None
    reset: int | None


def stage_handoff(i: int, stages: int, producer_blocks: int) -> Handoff:
    """Stage i of a chain of `stages` (module docstring); producer_blocks: stage i - 1's grid."""
    if stages < 3:
        raise ValueError(f"a counter chain needs at least 3 stages, got {stages}")
    if not 0 <= i < stages:
        raise ValueError(f"stage {i} of a {stages}-stage chain")
    polled = lambda j: 1 <= j <= stages - 2   # noqa: E731
    return Handoff(wait=i - 1 if polled(i) else None, wait_count=producer_blocks if polled(i) else 0,
                   done=i if polled(i + 1) else None, reset=i - 2 if i >= 2 else None)


def counter_plan(blocks: list[int]) -> list[Handoff]:
    """Every stage's handoff for a chain whose stage i launches blocks[i] blocks."""
    return [stage_handoff(i, len(blocks), blocks[i - 1] if i else 0) for i in range(len(blocks))]


class HandoffChain:
    """One pass of a counter chain as its launches are enqueued: `args(blocks)` gives the next
    launch's four kernel arguments (wait counter pointer, count, done pointer, reset pointer; 0
    for null). counters: the device address of at least `stages` uint32 counters."""

    def __init__(self, counters: int, stages: int):
        if stages < 3:
            raise ValueError(f"a counter chain needs at least 3 stages, got {stages}")
        self.counters, self.stages = int(counters), stages
        self.next_stage, self.producer_blocks = 0, 0

    def _pointer(self, index: int | None) -> int:
        return 0 if index is None else self.counters + 4 * index

    def args(self, blocks: int) -> tuple[int, int, int, int]:
        h = stage_handoff(self.next_stage, self.stages, self.producer_blocks)
        self.next_stage, self.producer_blocks = self.next_stage + 1, blocks
        return self._pointer(h.wait), h.wait_count, self._pointer(h.done), self._pointer(h.reset)

    @property
    def finished(self) -> bool:
        return self.next_stage == self.stages


NO_HANDOFF = (0, 0, 0, 0)   # a launch outside any chain: griddepcontrol.wait, no counter
