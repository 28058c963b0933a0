"""Runners for the fault-isolation and fuzz tests: the real numpy model with injected faults
(broken logits for one request, picked by its seed; a failure as a lost CUDA context), and a
fast stand-in model that reads every context back through the paged cache."""
from __future__ import annotations

import numpy as np

from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.reference.numpy_runner import NumpyRunner
from tinyvllm.reference.sampling import sample

POISONED_SEED = 666                     # the faulty runners pick their victim by its seed


class NaNRunner(NumpyRunner):
    """The real model, but the logits of any row sampled with POISONED_SEED become NaN (or +inf)
    from the victim's `after`-th step on."""

    def __init__(self, base: NumpyRunner, value=np.nan, after=0):
        self.__dict__.update(base.__dict__)
        self.value, self.after = value, after

    def execute(self, batch, sampling):
        logits = self.model.forward(batch, self.kv_cache)
        victim = (sampling.seed == POISONED_SEED) & (sampling.step >= self.after)
        logits[victim, 123] = self.value
        return sample(logits, sampling)


class DyingRunner(NumpyRunner):
    """Works for `good_steps` steps, then fails as a lost CUDA context would."""

    def __init__(self, base: NumpyRunner, good_steps: int):
        self.__dict__.update(base.__dict__)
        self.good_steps = good_steps

    def execute(self, batch, sampling):
        if self.good_steps == 0:
            raise RuntimeError("cuLaunchKernel failed: an illegal memory access was encountered")
        self.good_steps -= 1
        return super().execute(batch, sampling)


def context_hash(context) -> int:
    """ContextHashRunner's "model": the next token is a hash of the whole context, so reading one
    wrong slot (a paging, preemption or recompute mistake) changes the output. Ids 1000-100999:
    ordinary text tokens of the Llama 3 vocabulary, never a special one."""
    return 1000 + int(sum((i + 1) * int(t) for i, t in enumerate(context)) % 100_000)


def hash_generate(prompt, max_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(context_hash(tokens))
    return tokens[len(prompt):]


class ContextHashRunner(ModelRunner):
    """A ModelRunner whose K/V are the token ids themselves: each step writes the new tokens at
    their slots, reads every sequence's whole context back through its block table (asserting
    each slot was written) and returns context_hash(context); POISONED_SEED rows get -1, as
    the sampler gives a row of non-finite logits. ~1000x faster than the numpy model. A -1 is
    also a value a slot can be written with: a step launched ahead feeds a row the id its step
    before sampled before the engine has seen it, and a failed row's -1 is written like any id
    (the GPU embeds it as a zero row) until the engine throws that row's output away."""

    UNWRITTEN = -2

    def __init__(self, num_kv_blocks: int, block_size: int):
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.slots = np.full(num_kv_blocks * block_size, self.UNWRITTEN, np.int64)

    def execute(self, batch, sampling):
        self.slots[batch.slot_mapping] = batch.token_ids
        out = np.empty(batch.num_seqs, np.int32)
        for i in range(batch.num_seqs):
            pos = np.arange(int(batch.context_lens[i]))
            table = batch.block_tables[i]
            assert (table[:-(-len(pos) // self.block_size)] >= 0).all(), "context runs past the block table"
            context = self.slots[table[pos // self.block_size] * self.block_size + pos % self.block_size]
            assert (context != self.UNWRITTEN).all(), "read a KV slot that was never written"
            out[i] = -1 if sampling.seed[i] == POISONED_SEED else context_hash(context)
        return out

    def close(self) -> None:
        pass
