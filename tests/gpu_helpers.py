"""Device buffers for GPU tests: upload numpy arrays, poison outputs, read results back.
Imported only by tests marked `gpu` (it needs PyCUDA)."""
from __future__ import annotations

import contextlib
import os

import ml_dtypes
import numpy as np
import pycuda.driver as drv

BF16 = ml_dtypes.bfloat16
POISON = {np.dtype(BF16): np.uint16(0x7FC0), np.dtype(np.float32): np.uint32(0x7FC00000),
          np.dtype(np.int32): np.uint32(0x7FFFFFFF)}


class DeviceArray:
    """A device copy of a numpy array with the same dtype and shape."""

    def __init__(self, host: np.ndarray):
        self.host = np.ascontiguousarray(host)
        self._alloc = drv.mem_alloc(max(self.host.nbytes, 1))
        self.ptr = int(self._alloc)
        drv.memcpy_htod(self.ptr, self.host)

    @classmethod
    def poisoned(cls, shape, dtype) -> DeviceArray:
        """An output buffer filled with NaN (floats) / INT_MAX (ints): unwritten elements show."""
        dtype = np.dtype(dtype)
        pattern = POISON[dtype]
        return cls(np.full(shape, pattern, pattern.dtype).view(dtype))

    def get(self) -> np.ndarray:
        out = np.empty_like(self.host)
        drv.memcpy_dtoh(out, self.ptr)
        return out

    def __int__(self) -> int:
        return self.ptr

    __index__ = __int__   # so a DeviceArray can be passed straight to a 'P' kernel argument


def to_bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16)


def rel_err(got, want) -> float:
    r"""||got - want|| / ||want||, printed with the test's name (the error table in the notes
    comes from these lines: grep '^\[rel-err\]' in the log)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "output has NaN/inf (unwritten poison?)"
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("::")[-1]
    print(f"[rel-err] {test} {err:.2e}")
    return err


def shuffled_block_tables(rng, context_lens, block_size, num_blocks=None):
    """Disjoint, shuffled (non-contiguous) physical blocks per sequence."""
    need = [-(-c // block_size) for c in context_lens]
    total = num_blocks or sum(need) + 7
    perm = rng.permutation(total)
    tables, at = [], 0
    for n in need:
        tables.append([int(b) for b in perm[at:at + n]])
        at += n
    return tables, total


@contextlib.contextmanager
def decode_layer(runner, fused: bool):
    """The runner's decode steps on the fused layer (True) or the nine-launch one (False) inside
    the block, as EngineConfig.fused_decode would set them; the runner's own choice after."""
    from tinyvllm.gpu.step_shape import StepShape
    was = runner.ops.fused_decode
    runner.ops.fused_decode = fused
    try:
        assert runner.model.fused(StepShape(3, 3, is_prefill=False)) == fused
        yield
    finally:
        runner.ops.fused_decode = was


def _logits_rel(got, want) -> float:
    assert np.all(np.isfinite(got))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def logits_match_reference(cfg, runner, refm, ref32, block: int, noise_ratio: float,
                           step_ratio: float | None = None) -> None:
    """A prefill of three prompts (5, 23, 70 tokens) and 32 teacher-forced decode steps over
    shuffled block tables on the GPU runner, the bf16 numpy twin (refm, round_bf16=True) and the
    fp32 reference (ref32), compared every step (test_gpu_model.py's docstring says why so):
    the mean over the steps of the GPU's relative logits error against fp32 is at most
    noise_ratio times the twin's, each step's at most step_ratio times the twin's worst step
    where given (bf16 noise stays within a small factor of it; a broken step, a race or a stale
    K/V row, is off by O(1)), and the GPU's
    greedy token is the twin's except where the twin's top two logits are closer than twice
    that row's largest logit error."""
    from tinyvllm.engine.batch import ForwardBatch
    rng = np.random.default_rng()
    prompt_lens, steps = [5, 23, 70], 32
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in prompt_lens]
    need = [-(-(n + steps) // block) for n in prompt_lens]
    perm = [int(b) for b in rng.permutation(runner.num_kv_blocks)]
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(3)]
    ref_cache = refm.new_kv_cache(runner.num_kv_blocks, block)
    ref32_cache = ref32.new_kv_cache(runner.num_kv_blocks, block)

    ctx = list(prompt_lens)
    batch = ForwardBatch.build(prompts, ctx, tables, block, is_prefill=True)
    errors, fp32_gaps, bf16_gaps, mismatches = [], [], [], 0
    for step in range(steps + 1):
        got = runner.forward_logits(batch)
        want = refm.forward(batch, ref_cache)
        want32 = ref32.forward(batch, ref32_cache)
        errors.append(max(_logits_rel(got[i], want[i]) for i in range(3)))
        fp32_gaps.append(max(_logits_rel(got[i], want32[i]) for i in range(3)))
        bf16_gaps.append(max(_logits_rel(want[i], want32[i]) for i in range(3)))
        nxt = want.argmax(-1)               # teacher forcing: both sides continue with the twin's token
        top2 = np.sort(want, axis=-1)[:, -2:]
        for i in range(3):
            if got[i].argmax() != nxt[i]:
                # only a near-tie that this row's own logit error could flip is acceptable
                max_abs_err = float(np.abs(got[i] - want[i]).max())
                gap = float(top2[i, 1] - top2[i, 0])
                assert gap < 2 * max_abs_err, f"step {step} seq {i}: greedy token differs (gap {gap:.3f})"
                mismatches += 1
        ctx = [c + 1 for c in ctx]
        batch = ForwardBatch.build([[int(t)] for t in nxt], ctx, tables, block, is_prefill=False)
    show = lambda xs: " ".join(f"{e:.1e}" for e in xs)  # noqa: E731
    print(f"{cfg.family}: per-step max rel. logits error, gpu vs fp32:       ", show(fp32_gaps))
    print(f"{cfg.family}: per-step max rel. logits error, bf16-numpy vs fp32:", show(bf16_gaps))
    print(f"{cfg.family}: per-step max rel. logits error, gpu vs bf16-numpy: ", show(errors))
    print(f"greedy mismatches at near-ties: {mismatches}")
    if step_ratio is not None:
        assert max(fp32_gaps) <= step_ratio * max(bf16_gaps), (max(fp32_gaps), max(bf16_gaps))
    g, b = float(np.mean(fp32_gaps)), float(np.mean(bf16_gaps))
    assert g <= noise_ratio * b, f"mean error vs fp32: gpu {g:.2e}, bf16 numpy {b:.2e}"
