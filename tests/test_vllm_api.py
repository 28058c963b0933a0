"""vLLM's offline API on the numpy backend: LLM / generate / chat / SamplingParams(n, logprobs,
...) / RequestOutput.outputs[j], parallel samples sharing the prompt's KV blocks, stop reasons,
logprobs against log_softmax of the reference model's logits."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.outputs import Logprob
from tinyvllm.errors import InvalidRequestError, TinyVLLMError
from tinyvllm.reference.sampling import step_logprobs

OPTIONS = dict(device="cpu", num_kv_blocks=64, block_size=4, max_model_len=256)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), **OPTIONS)


def count_prefill_tokens(engine):
    """Wrap the scheduler's schedule() (every step with prompt work is scheduled; a step
    launched ahead is a decode step): -> per step with prompt work, the tokens of its rows that
    were not running before it, i.e. without the decode rows beside them; their sum is the
    prompt tokens run through the model."""
    scheduler = engine.scheduler
    counted, schedule = [], scheduler.schedule

    def counting():
        running = set(scheduler.running)
        batch = schedule()
        if batch is not None and batch.is_prefill:
            counted.append(sum(s.num_scheduled_tokens for s in batch.seqs if s not in running))
        return batch
    scheduler.schedule = counting
    return counted


# -- a script written against vLLM's offline API ---------------------------------------------
def test_vllm_script_runs_unchanged(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), **OPTIONS)
    sp = SamplingParams(n=2, logprobs=3, temperature=0.8, seed=0, presence_penalty=0.5, max_tokens=6)
    outputs = llm.generate(["Hello, my name is", {"prompt_token_ids": [1000, 2000, 3000]}], sampling_params=sp)
    for out in outputs:
        assert [o.index for o in out.outputs] == [0, 1]
        for o in out.outputs:
            assert len(o.token_ids) == len(o.logprobs) and isinstance(o.text, str)


def test_vllm_script_without_penalties(llm):
    sp = SamplingParams(n=2, logprobs=3, temperature=0.8, seed=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(["Hello, my name is", {"prompt_token_ids": [1000, 2000, 3000]}], sampling_params=sp)
    assert [o.prompt for o in outputs] == ["Hello, my name is", None]
    assert outputs[1].prompt_token_ids == [1000, 2000, 3000]
    for out in outputs:
        a, b = out.outputs
        assert (a.index, b.index) == (0, 1) and out.finished
        assert a.token_ids != b.token_ids, "two samples with their own random streams"
        for o in out.outputs:
            assert len(o.token_ids) == len(o.logprobs) == 6 and o.finish_reason == "length"
            for token, entry in zip(o.token_ids, o.logprobs):
                assert token in entry and all(isinstance(v, Logprob) for v in entry.values())
                assert len(entry) in (3, 4)           # the top 3, and the sampled one if not among them
            assert o.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)))
    # sample 0 of n=2 is the n=1 request with the same seed
    alone = llm.generate("Hello, my name is", SamplingParams(temperature=0.8, seed=0, max_tokens=6,
                                                             ignore_eos=True), use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_greedy_samples_equal_the_single_sample_greedy_text(llm):
    prompts = ["The capital of France is", {"prompt": "Once upon a time"}]
    many = llm.generate(prompts, SamplingParams(n=3, max_tokens=8, **GREEDY), use_tqdm=False)
    one = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    for m, o in zip(many, one):
        assert [s.text for s in m.outputs] == [o.outputs[0].text] * 3
        assert [s.token_ids for s in m.outputs] == [o.outputs[0].token_ids] * 3


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["a b", "c d"], [SamplingParams(max_tokens=2, **GREEDY),
                                         SamplingParams(max_tokens=3, **GREEDY)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3]
    with pytest.raises(InvalidRequestError, match="1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])


@pytest.mark.parametrize("prompts, message", [
    ({"prompt_token_ids": [5, 6], "prompt": "x"}, "a prompt dict must be"),
    ({"text": "hi"}, "a prompt dict must be"),
    ({"prompt_token_ids": "12"}, "a prompt dict must be"),
    ([1000, 2000], "a bare list of token ids is ambiguous"),
    (42, "prompts must be a str, a prompt dict, or a list of those, got int 42"),
    (["ok", 7], "a prompt must be a str"),
    (None, "got NoneType"),
])
def test_bad_prompt_types_are_one_clear_error(llm, prompts, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_a_dict_prompt_is_not_iterated_by_key(llm, tiny_model_dir):
    ids = llm.get_tokenizer().encode("prompt_token_ids")
    out = llm.generate({"prompt_token_ids": [1000, 2000, 3000]}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].prompt_token_ids == [1000, 2000, 3000] != ids


def test_chat_one_and_many_conversations(llm):
    conv = [{"role": "user", "content": "Hi"}]
    one = llm.chat(conv, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    two = llm.chat([conv, [{"role": "user", "content": "Yo"}]], sampling_params=SamplingParams(max_tokens=2, **GREEDY),
                   use_tqdm=False, add_generation_prompt=True)
    assert len(one) == 1 and len(two) == 2
    assert one[0].prompt_token_ids == two[0].prompt_token_ids == llm.get_tokenizer().encode_chat(conv)
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat("Hi")


def test_default_sampling_params_come_from_generation_config(llm, tiny_model_dir, tmp_path):
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (generation["temperature"], generation["top_p"])
    assert defaults.max_tokens == SamplingParams().max_tokens        # the file sets no max_new_tokens
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7,
                                                                 "max_new_tokens": 9}))
    other = LLM(str(tiny_model_dir), generation_config=str(tmp_path), **OPTIONS)
    d = other.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens, d.top_p) == (0.3, 7, 9, 1.0)
    assert LLM(str(tiny_model_dir), generation_config="vllm", **OPTIONS).get_default_sampling_params() == SamplingParams()
    with pytest.raises(TinyVLLMError, match="no generation_config.json there"):
        LLM(str(tiny_model_dir), generation_config=str(tmp_path / "nowhere"), **OPTIONS)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(TinyVLLMError, match=r"generation_config.json: its sampling defaults are not usable: .*temperature"):
        LLM(str(tiny_model_dir), generation_config=str(tmp_path), **OPTIONS)


def test_llm_argument_errors(tiny_model_dir, tmp_path):
    with pytest.raises(TinyVLLMError, match="dtype='float16' is not supported on device 'cpu'"):
        LLM(str(tiny_model_dir), dtype="float16", **OPTIONS)
    with pytest.raises(TinyVLLMError, match="only the model directory's own tokenizer"):
        LLM(str(tiny_model_dir), tokenizer=str(tmp_path), **OPTIONS)


# -- stop and finish reasons -------------------------------------------------------------------
def test_finish_and_stop_reasons(llm):
    prompt = "Once upon a time"
    full = llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert (full.finish_reason, full.stop_reason) == ("length", None)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = llm.generate(prompt, SamplingParams(max_tokens=12, stop=stop, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.text == full.text[:full.text.index(stop)]
    kept = llm.generate(prompt, SamplingParams(max_tokens=12, stop=stop, include_stop_str_in_output=True,
                                               **GREEDY), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)] and kept.stop_reason == stop
    token = full.token_ids[4]
    at = full.token_ids.index(token)
    by_id = llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[token], **GREEDY),
                         use_tqdm=False)[0].outputs[0]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", token)
    assert by_id.token_ids == full.token_ids[:at + 1]                    # the stop token is kept
    tok = llm.get_tokenizer()
    assert by_id.text == tok.decode(full.token_ids[:at])                 # but not its text
    with_text = llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[token],
                                                    include_stop_str_in_output=True, **GREEDY),
                             use_tqdm=False)[0].outputs[0]
    assert with_text.text == tok.decode(full.token_ids[:at + 1])


def test_min_tokens_holds_back_stop_token_ids(llm):
    prompt = "Once upon a time"
    full = llm.generate(prompt, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0].outputs[0]
    token = full.token_ids[1]
    late = llm.generate(prompt, SamplingParams(max_tokens=10, min_tokens=5, stop_token_ids=[token], **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    # vLLM's min_tokens masks the stop ids (and EOS) in the sampler until 5 tokens exist: the
    # greedy run takes the same first token, another at index 1, and never the stop id early
    ids = late.token_ids
    assert len(ids) >= 5 and ids[0] == full.token_ids[0] and ids[1] != token and token not in ids[:5]
    assert token not in ids[5:-1] and (ids[-1] == token or len(ids) == 10)   # a later one ends it


def test_skip_special_tokens(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_ids[0]
    plain = llm.generate("Hi", SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert tok.decode([eos], skip_special_tokens=True) == ""
    assert plain.text == tok.decode(plain.token_ids, skip_special_tokens=True)
    raw = llm.generate("Hi", SamplingParams(max_tokens=4, skip_special_tokens=False, **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert raw.text == tok.decode(raw.token_ids, skip_special_tokens=False)


# -- n samples: one prefill, shared blocks ---------------------------------------------------
def test_n_samples_cost_one_prefill_and_share_the_prompt_blocks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), **OPTIONS)
    engine, bm = llm.engine, llm.engine.block_manager
    counted = count_prefill_tokens(engine)
    prompt = [1000 + i for i in range(11)]            # 2 full blocks of 4, and 3 tokens
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    request = engine._requests["r"]
    parent, *children = request.seqs
    assert request.held == children and len(engine.scheduler.waiting) == 1
    engine.step()                                     # the parent's prefill; the others are released
    assert request.held == [] and counted == [11]
    engine.step()                                     # the children's prefill: the last partial block only
    assert counted == [11, 3 + 3]
    for child in children:
        assert child.block_table[:2] == parent.block_table[:2]
        assert child.block_table[2] != parent.block_table[2]      # its own copy of the partial block
        assert child.num_prefix_cached_tokens == 8
    assert [bm.ref_count(b) for b in parent.block_table[:2]] == [3, 3]
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    (out,) = finals
    assert [o.index for o in out.outputs] == [0, 1, 2] and all(o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert sum(counted) == 17 and bm.num_free_blocks == bm.num_blocks


def test_n_samples_without_prefix_caching_prefill_each(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), **{**OPTIONS, "enable_prefix_caching": False})
    counted = count_prefill_tokens(llm.engine)
    prompt = [1000 + i for i in range(11)]
    shared = LLM(str(tiny_model_dir), **OPTIONS).generate(
        {"prompt_token_ids": prompt}, SamplingParams(n=3, seed=5, max_tokens=4, ignore_eos=True), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, seed=5, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert sum(counted) == 3 * 11
    assert [o.token_ids for o in out[0].outputs] == [o.token_ids for o in shared[0].outputs]


def test_aborting_a_request_aborts_every_sample(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), **OPTIONS)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("held", [1000] * 9, SamplingParams(n=4, max_tokens=20, ignore_eos=True))
    engine.abort_request("held")                      # before its samples were released
    engine.add_request("running", [2000] * 9, SamplingParams(n=2, max_tokens=20, ignore_eos=True))
    finals = {}
    for _ in range(2):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finals) == ["held"]
    engine.abort_request("running")
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finals) == ["held", "running"]
    for out in finals.values():
        assert {o.finish_reason for o in out.outputs} == {"abort"}
    assert bm.num_free_blocks == bm.num_blocks


# -- logprobs ---------------------------------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 rows -> their log-probabilities in float64: the oracle of the logprob tests."""
    x = np.asarray(logits, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_logprobs_are_log_softmax_of_the_reference_logits(llm):
    model = llm.engine.runner.model
    prompt = [1000, 2000, 3000, 4000, 5000]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=5, logprobs=3, **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    # The engine's logits come from the paged forward, the reference's from a dense recompute
    # (forward_full) of the same float32 model: the same sums in another order. Their logits agree
    # to a few float32 ulps of |logit| (< 10 here: 1e-5 absolute covers 16 ulps of 8.0), and a
    # log-probability moves by at most twice a logit error (the max and the log-sum-exp shift).
    tol = 2e-5
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        lp = log_softmax(model.forward_full(prompt + out.token_ids[:j])[-1])
        top = np.argsort(-lp, kind="stable")[:3]
        assert list(entry)[:3] == top.tolist() and token == top[0]          # greedy: the top one
        for rank, t in enumerate(top.tolist(), 1):
            assert entry[t].rank == rank and abs(entry[t].logprob - lp[t]) < tol
            assert entry[t].decoded_token == llm.get_tokenizer().decode([t], skip_special_tokens=False)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_logprobs_zero_gives_the_sampled_token_only(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=3, logprobs=0, temperature=1.0, seed=3),
                       use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in out.logprobs] == [[t] for t in out.token_ids]
    assert all(e[t].rank >= 1 and e[t].logprob <= 0 for t, e in zip(out.token_ids, out.logprobs))
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs is None


def test_prompt_logprobs(llm):
    model = llm.engine.runner.model
    prompt = [1000, 2000, 3000, 4000]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    logits = model.forward_full(prompt)
    # the very computation of the step path's logprobs (reference/sampling.py's twin), bit for bit
    sampled, ranks, top_ids, top_lps = step_logprobs(logits[:-1], np.array(prompt[1:]), 2)
    lp = log_softmax(logits)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert prompt[i] in entry and entry[prompt[i]].logprob == float(sampled[i - 1])
        assert list(entry)[:2] == top_ids[i - 1].tolist() == np.argsort(-lp[i - 1], kind="stable")[:2].tolist()
        assert [entry[t].logprob for t in top_ids[i - 1].tolist()] == top_lps[i - 1].tolist()
        if prompt[i] not in top_ids[i - 1]:
            assert entry[prompt[i]].rank == ranks[i - 1]
        # and against float64: fp32(x - fp32(lse)) is within two roundings of |x| + |lse| of it
        x, exact = float(logits[i - 1, prompt[i]]), lp[i - 1, prompt[i]]
        assert abs(entry[prompt[i]].logprob - exact) <= 2 * 2.0 ** -24 * (abs(x) + abs(x - exact))


def test_unsupported_features_are_refused_at_add_request(llm):
    runner = llm.engine.runner
    runner.supports_prompt_logprobs = False            # as on cuda
    try:
        with pytest.raises(InvalidRequestError, match="prompt_logprobs=1: not supported on cpu"):
            llm.engine.add_request("x", "Hi", SamplingParams(prompt_logprobs=1))
    finally:
        del runner.supports_prompt_logprobs
    assert not llm.engine.has_unfinished_requests()


# -- on the GPU (run by the lead on the H200) ---------------------------------------------------
@pytest.mark.gpu
def test_cuda_n_samples_share_one_prefill_and_greedy_equals_single(tiny_model_dir):
    """Greedy samples 1..3 of one request read the same shared KV blocks and each recomputes the
    same partial block in one batch (same kernels, same tokens, same shapes), so their ids must
    be exactly equal. Sample 0 and the n = 1 request prefill the whole prompt in another batch
    shape (27 tokens from scratch, not 11 after a cached block), and sample 0's second token
    comes from the step that prefills the others (its decode row in that prefill-kind forward):
    bf16 summation order differs, so those comparisons allow a near-tie at the first difference,
    as test_gpu_engine.assert_same_greedy (its NEAR_TIE bound) does."""
    from test_gpu_engine import assert_same_greedy

    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    from tinyvllm.reference.model import ReferenceModel
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    refm = ReferenceModel(cfg, load_weights(tiny_model_dir, cfg))
    ids = [int(t) for t in np.random.default_rng().integers(0, cfg.vocab_size, 27)]   # 1 block of 16 + 11
    llm = LLM(str(tiny_model_dir), device="cuda", kv_cache_gb=0.25, max_model_len=256)
    try:
        counted = count_prefill_tokens(llm.engine)
        many = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=4, max_tokens=12, **GREEDY),
                            use_tqdm=False)[0]
        assert sum(counted) == 27 + 3 * 11, "samples 1..3 recompute only the partial block"
        first, *others = [list(o.token_ids) for o in many.outputs]
        assert len({tuple(t) for t in others}) == 1
        assert_same_greedy(refm, ids, first, others[0], "sample 0 vs samples 1..3")
        one = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=12, **GREEDY),
                           use_tqdm=False)[0].outputs[0]
        assert_same_greedy(refm, ids, others[0], one.token_ids, "n=4 vs n=1")
        assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
        with pytest.raises(InvalidRequestError, match="prompt_logprobs=1: not supported on cuda"):
            llm.generate("Hi", SamplingParams(prompt_logprobs=1))
        # logprobs come from the GPU sampler: the sampled token's entry and the top 2 per token
        lp = llm.generate("Hi", SamplingParams(logprobs=2, max_tokens=4, **GREEDY), use_tqdm=False)[0].outputs[0]
        assert len(lp.logprobs) == len(lp.token_ids) == 4
        for token, entry in zip(lp.token_ids, lp.logprobs):
            assert token in entry and entry[token].rank == 1 and entry[token].logprob <= 0   # greedy: top 1
    finally:
        llm.engine.close()
