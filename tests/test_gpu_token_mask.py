"""Structured outputs on the GPU: cuda/token_mask.cu's apply_token_mask (through its launcher
in gpu/ops/sampling.py) against reference/sampling.py's apply_token_mask on fresh random
logits and bits, with every row the kernel must not touch poisoned first; the masked sampler step
against sample_step; and CudaRunner's constrained road end to end (greedy rows must not take the
LM head's argmax keys of the unmasked logits).

Tolerances: none. The kernel writes -inf or leaves a logit alone, so its output is bit-exact;
the ids sampled from masked logits are exact for the reasons test_gpu_logit_processing gives.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tinyvllm.engine.batch import SamplingBatch
from tinyvllm.reference.sampling import apply_token_mask, sample_step
from tinyvllm.structured.mask import TokenMask

pytestmark = pytest.mark.gpu

VOCAB = 128256


def random_mask(rng, num_seqs: int, vocab: int) -> TokenMask:
    """Random rows (a subset, unordered) with bits of every density: all refused, all allowed,
    one token, sparse, half."""
    rows = rng.permutation(num_seqs)[:max(1, num_seqs * 2 // 3)].astype(np.int32)
    words = (vocab + 31) // 32
    bits = np.zeros((len(rows), words), np.uint32)
    for j in range(len(rows)):
        kind = j % 5
        if kind == 1:
            bits[j] = 0xFFFFFFFF
        elif kind == 2:
            t = int(rng.integers(0, vocab))
            bits[j, t // 32] = np.uint32(1) << np.uint32(t % 32)
        elif kind == 3:
            for t in rng.integers(0, vocab, 50):
                bits[j, t // 32] |= np.uint32(1) << np.uint32(t % 32)
        elif kind == 4:
            bits[j] = rng.integers(0, 2**32, words, dtype=np.uint64).astype(np.uint32)
    return TokenMask(rows, bits.view(np.int32))


def gpu_mask(gpu_ops, logits: np.ndarray, mask: TokenMask) -> np.ndarray:
    import pycuda.driver as drv
    n, vocab = logits.shape
    guarded = np.concatenate([logits, np.full((1, vocab), np.nan, np.float32)])   # a guard row past the end
    dev = drv.to_device(np.ascontiguousarray(guarded))
    rows = drv.to_device(np.ascontiguousarray(mask.rows, np.int32))
    bits = drv.to_device(np.ascontiguousarray(mask.bits, np.int32))
    gpu_ops.apply_token_mask(int(dev), vocab, int(rows), int(bits), mask.bits.shape[1], mask.num_rows)
    drv.Context.synchronize()
    out = drv.from_device(dev, guarded.shape, np.float32)
    assert np.all(np.isnan(out[n])), "apply_token_mask wrote past the last row"
    return out[:n]


@pytest.mark.parametrize("vocab", [VOCAB, 49152, 1000, 33])
def test_apply_token_mask_is_bit_exact(gpu_ops, rng, vocab):
    n = 24
    logits = (rng.standard_normal((n, vocab)) * 4).astype(np.float32)
    logits[rng.integers(0, n, 40), rng.integers(0, vocab, 40)] = np.nan     # NaN, +inf, -inf:
    logits[rng.integers(0, n, 40), rng.integers(0, vocab, 40)] = np.inf     # refused ones become
    logits[rng.integers(0, n, 40), rng.integers(0, vocab, 40)] = -np.inf    # -inf, the rest stay
    mask = random_mask(rng, n, vocab)
    unmasked = np.setdiff1d(np.arange(n), mask.rows)
    logits[unmasked] = np.nan                    # poison: rows without a mask must come back as they went
    expected = apply_token_mask(logits.copy(), mask)
    got = gpu_mask(gpu_ops, logits, mask)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert np.all(np.isnan(got[unmasked]))


def test_masked_step_samples_like_the_twin(gpu_ops, rng):
    """Mask, then the sampler (greedy and sampled rows, top-k/top-p, min_p) against sample_step:
    the same ids, each allowed by its row's bits."""
    import pycuda.driver as drv
    n = 48
    logits = (rng.standard_normal((n, VOCAB)) * rng.choice([1.0, 4.0, 10.0])).astype(np.float32)
    mask = random_mask(rng, n, VOCAB)
    keep = [j for j in range(mask.num_rows) if mask.bits[j].any()]      # an all-refused row is broken
    mask = TokenMask(mask.rows[keep], mask.bits[keep])
    batch = SamplingBatch.build(rng.choice([0.0, 0.7, 1.0], n), rng.choice([-1, 50], n), rng.choice([1.0, 0.9], n),
                                rng.integers(0, 2**63, n), rng.integers(0, 500, n), min_p=rng.choice([0.0, 0.1], n),
                                token_mask=mask)
    expected, _ = sample_step(logits.copy(), batch)
    masked = gpu_mask(gpu_ops, logits, mask)
    args = {name: drv.to_device(np.ascontiguousarray(a)) for name, a in (
        ("logits", masked), ("temperature", batch.temperature), ("top_k", batch.top_k), ("top_p", batch.top_p),
        ("min_p", batch.min_p), ("seed", batch.seed), ("step", batch.step))}
    out = drv.to_device(np.full(n, 2**31 - 1, np.int32))
    gpu_ops.sample(int(args["logits"]), n, VOCAB, int(args["temperature"]), int(args["top_k"]), int(args["top_p"]),
                   int(args["seed"]), int(args["step"]), int(out), min_p=int(args["min_p"]))
    drv.Context.synchronize()
    ids = drv.from_device(out, (n,), np.int32)
    np.testing.assert_array_equal(ids, expected)
    words = mask.bits.view(np.uint32)
    for j, row in enumerate(mask.rows):
        t = int(ids[row])
        assert (words[j, t // 32] >> (t % 32)) & 1, f"row {row} sampled refused token {t}"


SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["alpha", "beta", "gamma"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["id", "kind", "tags"], "additionalProperties": False}


def test_cuda_runner_constrained_rows_stay_in_their_grammar(tiny_model_dir):
    """Greedy and sampled constrained rows beside unconstrained ones on the CUDA backend: every
    constrained output validates and ends with stop (a greedy row that took the LM head's
    argmax keys of the unmasked logits would leave its grammar and fail); the unconstrained rows
    run to their length; a run without constraints never touches the mask stage."""
    jsonschema = pytest.importorskip("jsonschema")
    from tinyvllm.engine.llm import LLM
    from tinyvllm.engine.sampling_params import SamplingParams
    from tinyvllm.structured import StructuredOutputsParams
    llm = LLM(str(tiny_model_dir), device="cuda", max_model_len=256)
    try:
        free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        llm.generate(["Hello", "Tell me"], free, use_tqdm=False)
        runner = llm.engine.runner
        assert runner.token_masks.copy_stream is None          # unconstrained steps: no mask work
        constrained = [SamplingParams(max_tokens=96, temperature=t, seed=s,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMA))
                       for t, s in ((0, 0), (1.0, 1), (0.8, 2), (0, 3))]
        outs = llm.generate(["Hello", "Tell me", *["x"] * 4], [free, free, *constrained], use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 24 and o.outputs[0].finish_reason == "length" for o in outs[:2])
        for o in outs[2:]:
            assert o.outputs[0].finish_reason == "stop", o.outputs[0]
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        assert runner.token_masks.copy_stream is not None
    finally:
        llm.engine.close()


def recording(runner, ahead: list):
    """runner.launch, noting for each step launched with a PendingTokenMask whether, once
    launch() returned, the mask was made already and the step's sampler was still to come."""
    from tinyvllm.structured.mask import PendingTokenMask
    launch = runner.launch

    def launch_and_note(batch, sampling, *args):
        step = launch(batch, sampling, *args)
        if isinstance(sampling.token_mask, PendingTokenMask):
            ahead.append((sampling.token_mask.resolved, runner._unsampled is sampling.token_mask))
        return step
    return launch_and_note


def _run_steps(engine, requests):
    """Add every request, step to the end -> (each step() call's (request id, token ids, finish
    reason) triples, each request's final (token ids, finish reason, text))."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    calls, finals = [], {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        calls.append([(o.request_id, tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs])
        finals.update((o.request_id, (list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].text))
                      for o in outs)
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    return calls, finals


def test_constrained_steps_launched_ahead_match_sync_scheduling(tiny_model_dir):
    """Async scheduling on the CUDA backend: a decode step holding constrained rows goes ahead,
    its forward enqueued before the host makes its mask (a PendingTokenMask, still unmade when
    launch() returns, its sampler not enqueued yet), the mask then resolved once the step before
    is applied. Against the same engine without async scheduling:
    - constrained rows that end only by length (a regex longer than max_tokens), greedy and
      seeded, beside plain rows: every step has the same rows either way (the same graphs, the
      same bits), so every step() call reports the same tokens;
    - rows whose grammar completes (JSON, choice, regex) are computed and thrown away in a step
      launched ahead, so the batches, and with them the summation order, may differ: greedy
      tokens equal up to a bf16 near-tie (test_gpu_engine's assert_same_greedy), and every JSON
      output that stops validates."""
    jsonschema = pytest.importorskip("jsonschema")
    from test_gpu_engine import assert_same_greedy

    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.engine.sampling_params import SamplingParams
    from tinyvllm.reference.model import ReferenceModel
    from tinyvllm.structured import StructuredOutputsParams as SO
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    refm = ReferenceModel(cfg, load_weights(tiny_model_dir, cfg))
    rng = np.random.default_rng()
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (3, 17, 40, 9, 64, 5, 33)]
    letters = SO(regex="[a-z]{400}")                      # no completion within 24 tokens
    by_length = [(f"L{i}", p, SamplingParams(max_tokens=24, structured_outputs=letters if i < 4 else None,
                                             ignore_eos=True, **kw))
                 for i, (p, kw) in enumerate(zip(prompts, [dict(temperature=0), dict(temperature=1.0, seed=1),
                                                            dict(temperature=0.8, top_p=0.9, seed=2),
                                                            dict(temperature=0), dict(temperature=0),
                                                            dict(temperature=0.9, seed=3)]))]
    constraints = [SO(json=SCHEMA), SO(json=SCHEMA), SO(choice=["left", "right", "up"]),
                   SO(regex="[a-f]{2,12}-[0-9]{1,4}"), SO(json=SCHEMA), None, None]
    completing = [(str(i), p, SamplingParams(temperature=0, max_tokens=64, structured_outputs=c, ignore_eos=c is None))
                  for i, (p, c) in enumerate(zip(prompts, constraints))]
    runs, ahead = {}, []
    for mode in (False, True):
        engine = LLMEngine(tiny_model_dir, device="cuda", kv_cache_gb=0.5, max_model_len=256, async_scheduling=mode)
        engine.runner.launch = recording(engine.runner, ahead)
        try:
            runs[mode] = _run_steps(engine, by_length), _run_steps(engine, completing)[1]
        finally:
            engine.close()
        if not mode:
            assert not ahead, "no step goes ahead without async scheduling"
    assert len(ahead) >= 20 and all(not resolved and unsampled for resolved, unsampled in ahead), ahead
    (sync_calls, sync_finals), _ = runs[False]
    assert runs[True][0][0] == sync_calls
    assert all(sync_finals[f"L{i}"][1] == "length" for i in range(len(by_length)))
    diverged = 0
    for (request_id, prompt, _), c in zip(completing, constraints):
        (a, reason_a, text_a), (b, reason_b, _) = runs[True][1][request_id], runs[False][1][request_id]
        at = assert_same_greedy(refm, prompt, a, b, f"request {request_id}")
        diverged += at is not None
        if at is None:
            assert reason_a == reason_b, (request_id, reason_a, reason_b)
        if c is not None and c.kind == "json" and reason_a == "stop":
            jsonschema.validate(json.loads(text_a), SCHEMA)
    print(f"{len(ahead)} constrained steps launched ahead; near-tie divergences: {diverged} of {len(completing)}")
