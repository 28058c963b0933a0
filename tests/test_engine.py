"""LLMEngine / LLM on the numpy backend with the tiny random model: the real scheduler, block
manager, reference model and sampling, end to end."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.engine.llm import LLM
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import InvalidRequestError, TinyVLLMError

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """A small cache (40 blocks of 4 tokens) shared by tests that leave it empty."""
    return LLMEngine(tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=40, max_num_seqs=8,
                     max_model_len=160)


@pytest.fixture(scope="module")
def reference(engine):
    return engine.runner.model


def run_all(engine, requests, sample=0):
    """requests: {id: (prompt, params)} -> {id: the final CompletionOutput of that sample};
    checks every sample's delta stream."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals, streamed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not out.finished or out.request_id not in finals
            for o in out.outputs:
                key = (out.request_id, o.index)
                streamed[key] = streamed.get(key, "") + o.delta_text
                assert o.text == streamed[key]
            if out.finished:
                finals[out.request_id] = out.outputs[sample]
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    return finals


def random_prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1000, 100000, rng.integers(2, 45))] for _ in range(n)]


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_batched_greedy_equals_each_request_alone(tiny_model_dir, reference, scheduling):
    eng = LLMEngine(tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=16, max_num_seqs=6,
                    max_num_batched_tokens=128, scheduling=scheduling, max_model_len=64)
    prompts = random_prompts(13)                 # 2..44 tokens; the longest request needs 14 blocks
    max_tokens = [4 + i % 9 for i in range(13)]
    finals = run_all(eng, {str(i): (p, SamplingParams(max_tokens=m, **GREEDY))
                           for i, (p, m) in enumerate(zip(prompts, max_tokens))})
    assert eng.num_preemptions > 0, "the cache was meant to be too small for all at once"
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        out = finals[str(i)]
        assert out.token_ids == reference.greedy_generate(p, m), f"request {i}"
        assert out.finish_reason == "length" and out.stop_reason is None


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_model_dir, engine):
    params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=1234, max_tokens=8,
                            ignore_eos=True)
    prompt = "The quick brown fox"
    alone = run_all(engine, {"x": (prompt, params)})["x"]
    crowded = LLMEngine(tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=20, max_num_seqs=4,
                        max_model_len="auto")
    others = {str(i): (p, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))
              for i, p in enumerate(random_prompts(6, seed=3))}
    batched = run_all(crowded, {**others, "x": (prompt, params)})["x"]
    assert batched.token_ids == alone.token_ids and batched.text == alone.text
    assert crowded.num_preemptions > 0
    other_seed = run_all(engine, {"y": (prompt, SamplingParams(**{**params.__dict__, "seed": 99}))})
    assert other_seed["y"].token_ids != alone.token_ids


def test_unseeded_requests_get_seeds_from_the_engine_seed(tiny_model_dir):
    def tokens():
        eng = LLMEngine(tiny_model_dir, device="cpu", num_kv_blocks=64, seed=7, max_model_len=1024)
        return [o.token_ids for o in run_all(eng, {
            "a": ("Hello", SamplingParams(max_tokens=6, ignore_eos=True)),
            "b": ("Hello", SamplingParams(max_tokens=6, ignore_eos=True))}).values()]
    first = tokens()
    assert first == tokens() and first[0] != first[1]


def greedy_text(engine, prompt, n):
    return run_all(engine, {"g": (prompt, SamplingParams(max_tokens=n, **GREEDY))})["g"]


def test_stop_string_is_cut_from_the_text(engine):
    full = greedy_text(engine, "Once upon a time", 12)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    out = run_all(engine, {"s": ("Once upon a time", SamplingParams(max_tokens=12, stop=[stop, "@@@"],
                                                                    **GREEDY))})["s"]
    assert out.finish_reason == "stop" and stop not in out.text and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]


def test_stop_token_ids_and_eos(engine):
    full = greedy_text(engine, "Hello", 8)
    stop_token = full.token_ids[3]
    cut = full.token_ids.index(stop_token) + 1
    out = run_all(engine, {"t": ("Hello", SamplingParams(max_tokens=8, stop_token_ids=[stop_token],
                                                         **GREEDY))})["t"]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:cut]
    assert out.stop_reason == stop_token and out.text == engine.tokenizer.decode(out.token_ids[:-1])
    eos = engine.output_processor.eos_token_ids
    engine.output_processor.eos_token_ids = frozenset({stop_token})      # make the model "say" EOS
    try:
        out = run_all(engine, {"e": ("Hello", SamplingParams(max_tokens=8, temperature=0))})["e"]
        assert out.finish_reason == "stop" and out.stop_reason is None  # vLLM: EOS is "stop", no reason
        assert out.token_ids == full.token_ids[:cut]
        out = run_all(engine, {"i": ("Hello", SamplingParams(max_tokens=8, **GREEDY))})["i"]
        assert out.finish_reason == "length" and out.token_ids == full.token_ids
    finally:
        engine.output_processor.eos_token_ids = eos


def test_max_tokens_and_metrics(engine):
    engine.add_request("m", "Hello there", SamplingParams(max_tokens=5, **GREEDY))
    (request,) = run_all_pending(engine).values()
    out, metrics = request.outputs[0], request.metrics
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.finished and request.finished
    assert metrics.time_to_first_token > 0 and metrics.latency >= metrics.time_to_first_token
    assert metrics.decode_tokens_per_s > 0


def test_abort_frees_blocks_and_reports_abort(engine):
    params = SamplingParams(max_tokens=30, **GREEDY)
    for i in range(3):
        engine.add_request(f"ab{i}", "Tell me a story", params)
    engine.step()
    engine.step()
    free = engine.num_free_blocks
    engine.abort_request("ab1")
    engine.abort_request("no-such-request")
    assert engine.num_free_blocks > free
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert finals["ab1"].finish_reason == "abort" and len(finals["ab1"].token_ids) < 30
    assert finals["ab0"].token_ids == finals["ab2"].token_ids and len(finals["ab0"].token_ids) == 30
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_bad_requests_are_rejected_without_touching_the_others(engine, reference):
    prompt = random_prompts(1, seed=5)[0]
    engine.add_request("good", prompt, SamplingParams(max_tokens=4, **GREEDY))
    forced = [SamplingParams(), SamplingParams()]          # values the constructor refuses, forced
    object.__setattr__(forced[0], "temperature", -1)
    object.__setattr__(forced[1], "top_p", 0)
    bad = [("p", "x", forced[0]), ("q", "x", forced[1]),
           ("good", "x", None), ("e", "", None), ("l", [], None), ("v", [10**7], None),
           ("w", [1.5], None), ("long", list(range(1, 5000)), None), ("cache", list(range(1, 200)), None),
           ("n", None, None), ("surrogate", "a\ud800b", None)]
    for request_id, p, params in bad:
        with pytest.raises(InvalidRequestError):
            engine.add_request(request_id, p, params)
    finals = run_all_pending(engine)
    assert list(finals) == ["good"] and finals["good"].outputs[0].token_ids == reference.greedy_generate(prompt, 4)


def run_all_pending(engine):
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


def test_llm_generate_keeps_input_order_and_chat(tiny_model_dir, reference):
    llm = LLM(tiny_model_dir, device="cpu", num_kv_blocks=64, max_model_len=1024)
    prompts = random_prompts(4, seed=9)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=2 + i, **GREEDY) for i in range(4)])
    assert [o.outputs[0].token_ids for o in outs] == [reference.greedy_generate(p, 2 + i)
                                                       for i, p in enumerate(prompts)]
    single = llm.generate("Hi", SamplingParams(max_tokens=3))
    assert len(single) == 1 and len(single[0].outputs[0].token_ids) <= 3
    chats = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]],
                     SamplingParams(max_tokens=2))
    assert len(chats) == 2
    assert chats[0].prompt_token_ids == llm.get_tokenizer().encode_chat([{"role": "user", "content": "Hi"}])
    assert chats[0].prompt_token_ids.count(llm.get_tokenizer().bos_token_id) == 1
    own = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1),
                   chat_template="{{ greeting }}{{ messages[0]['content'] }}",
                   chat_template_kwargs={"greeting": "Well, "})
    assert own[0].prompt_token_ids == llm.get_tokenizer().encode("Well, Hi", add_special_tokens=False)
    with pytest.raises(InvalidRequestError):           # all or nothing: nothing is left queued
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == 64


def test_engine_option_errors_are_user_errors(tiny_model_dir):
    with pytest.raises(TinyVLLMError, match="unknown engine option"):
        LLMEngine(tiny_model_dir, device="cpu", max_num_sequences=3)
    with pytest.raises(TinyVLLMError, match="block_size"):
        LLMEngine(tiny_model_dir, device="cpu", block_size=3)
