"""CudaRunner's two-part launch of a step whose only extra is a token mask (gpu/step_sampling.py,
gpu/structured_ops.py), on the CPU: the runner's own code drives a stand-in for PyCUDA's driver
that records, in order, what is enqueued on which stream. The forward is enqueued at launch and
nothing of the mask or the sampler before the PendingTokenMask is resolved; then the mask's copy
(on the copy stream, after the last apply_token_mask has read the buffer), the stream's wait for
it, apply_token_mask, the sampler (not on the LM head's argmax keys) and the ids' event. A step
left unresolved is sampled before the next step is staged, or when it is waited for. Run in a
child interpreter, so the stand-in never meets the rest of the test session's imports."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_DRIVER = '''
import numpy as np
LOG = []
class Stream:
    count = 0
    def __init__(self, name=None):
        Stream.count += 1
        self.name = name or f"copy{Stream.count}"
    def wait_for_event(self, event):
        LOG.append((self.name, "wait", event.name))
class Event:
    count = 0
    def __init__(self, name=None):
        Event.count += 1
        self.name = name or f"event{Event.count}"
    def record(self, stream):
        LOG.append((stream.name, "record", self.name))
    def synchronize(self):
        LOG.append(("host", "sync", self.name))
class _Allocation(int):
    def free(self):
        pass
def mem_alloc(size):
    return _Allocation(1 << 20)
def pagelocked_empty(size, dtype):
    return np.zeros(size, dtype)
def memcpy_htod_async(dev, host, stream):
    LOG.append((stream.name, "copy", int(host.nbytes)))
'''

SCRIPT = '''
import contextlib
import numpy as np
import pycuda.driver as drv
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.gpu.cuda_runner import CudaRunner
from tinyvllm.gpu.step_shape import StepShape
from tinyvllm.gpu.step_sampling import GrowingBuffers
from tinyvllm.gpu.structured_ops import TokenMaskStage
from tinyvllm.structured.mask import PendingTokenMask, TokenMask
LOG = drv.LOG

class Ops:
    def sample(self, logits, rows, vocab, *args, head_argmax=0, **kw):
        LOG.append(("main", "sample", head_argmax))
    def apply_token_mask(self, logits, vocab, rows, bits, words, num_rows):
        LOG.append(("main", "apply_token_mask", num_rows))

class Graph:
    def __init__(self, kind):
        self.kind = kind
    def launch(self, stream):
        LOG.append((stream.name, self.kind))

class Model:
    def forward(self, step):
        LOG.append(("main", "eager forward"))
    def head_argmax_for(self, step):
        return 77

class Device:
    @contextlib.contextmanager
    def active(self):
        yield

class Arena:
    def view(self, name, bank=None):
        return 4096

class Mask(PendingTokenMask):
    """A pending mask of given bits (no matchers), logging when it is made."""
    def __init__(self, mask, label):
        super().__init__([])
        self.fixed, self.label = mask, label
    def resolve(self):
        if not self.resolved:
            LOG.append(("host", "mask made", self.label))
            self._mask = self.fixed
            callbacks, self._callbacks = self._callbacks, None
            for callback in callbacks:
                callback(self._mask)
        return self._mask

runner = object.__new__(CudaRunner)
runner.device, runner.stream, runner.ops, runner.model, runner.arena = Device(), drv.Stream("main"), Ops(), Model(), Arena()
runner.cfg = type("Cfg", (), {"vocab_size": 64})()
runner.scratch = GrowingBuffers()
runner.token_masks = TokenMaskStage(runner.ops, runner.scratch)
runner._unsampled, runner.last_logprobs = None, None
runner._ids_host = [np.arange(8, dtype=np.int32) + 100 * b for b in range(2)]
runner._ids_ready = [drv.Event(f"ids{b}") for b in range(2)]
runner._ids_host_device_ptrs = [0, 0]
banks = iter([0, 1, 0, 1, 0, 1])
def stage(batch, sampling, rows=None):
    bank = next(banks)
    LOG.append(("host", "stage", bank))
    return StepShape(num_tokens=batch.num_seqs, num_seqs=batch.num_seqs, is_prefill=False, max_query_len=1, bank=bank)
runner._stage_inputs = stage
runner._graph_size_for = lambda s: 4
runner._forward_graph = lambda step: Graph("forward graph")
runner.graphs = {(4, b): Graph("decode graph") for b in range(2)}

def decode(fed):
    batch = ForwardBatch.build_decode([1, 2, 3, 4], [5, 5, 5, 5], np.zeros((4, 2), np.int32), 4)
    if fed:
        batch.fed_rows = np.arange(4, dtype=np.int32)
    return batch

def masked(label):
    bits = np.zeros((2, 2), np.int32)
    sampling = SamplingBatch.greedy(4)
    sampling.token_mask = Mask(TokenMask(np.asarray([0, 2], np.int32), bits), label)
    return sampling

def since(mark):
    out = LOG[mark:]
    return [entry for entry in out]

# 1. a masked step launched ahead: the forward only
a = masked("A")
mark = len(LOG)
step_a = runner.launch(decode(True), a)
assert since(mark) == [("host", "stage", 0), ("main", "forward graph")], since(mark)
assert runner._unsampled is a.token_mask
# 2. its mask made (by the engine): copy after the last apply, wait, apply, sample, ids event
mark = len(LOG)
a.token_mask.resolve()
got = since(mark)
assert got[0] == ("host", "mask made", "A")
uploaded, applied = runner.token_masks.uploaded.name, runner.token_masks.applied.name
copy_stream = runner.token_masks.copy_stream.name
assert [e for e in got if e[0] == copy_stream] == [
    (copy_stream, "wait", applied), (copy_stream, "copy", 24), (copy_stream, "record", uploaded)], got
assert [e for e in got if e[0] == "main"] == [
    ("main", "wait", uploaded), ("main", "apply_token_mask", 2), ("main", "record", applied),
    ("main", "sample", 0),         # a masked row must not take the LM head's unmasked argmax keys
    ("main", "record", "ids0")], got
assert got.index(("host", "sync", uploaded)) < got.index((copy_stream, "copy", 24)), "host buffer reused too soon"
assert runner._unsampled is None
# 3. a second masked step left unresolved: the next launch samples it before staging
b = masked("B")
runner.launch(decode(True), b)
mark = len(LOG)
step_c = runner.launch(decode(True), SamplingBatch.greedy(4))
got = since(mark)
kinds = [e[1] for e in got]
assert kinds[0] == "mask made" and kinds.index("sample") < kinds.index("stage") < kinds.index("decode graph"), got
assert got.index((copy_stream, "wait", applied)) < got.index((copy_stream, "copy", 24)) < got.index(("main", "sample", 0))
# 4. a step waited for before its mask is made: made, sampled, then read
d = masked("D")
step_d = runner.launch(decode(True), d)
mark = len(LOG)
ids = step_d.wait()
got = since(mark)
assert got[0] == ("host", "mask made", "D") and got[-1] == ("host", "sync", "ids1"), got
assert got[-3:-1] == [("main", "sample", 0), ("main", "record", "ids1")], got
assert ids.tolist() == [100, 101, 102, 103]
# 5. a pending mask with no row left (every constrained row finished): unmasked, on the head's keys
e = masked("E")
e.token_mask.fixed = None
runner.launch(decode(True), e)
mark = len(LOG)
e.token_mask.resolve()
assert [x for x in since(mark) if x[1] == "sample"] == [("main", "sample", 77)]
assert not [x for x in since(mark) if x[1] in ("copy", "apply_token_mask")]
print("ordering ok")
'''


def test_cuda_runner_enqueues_the_mask_and_sampler_after_the_forward(tmp_path):
    (tmp_path / "pycuda").mkdir()
    (tmp_path / "pycuda" / "__init__.py").write_text("")
    (tmp_path / "pycuda" / "driver.py").write_text(FAKE_DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "ordering ok" in done.stdout, done.stdout + done.stderr
