"""Structured outputs offline (tinyvllm/structured/), on the numpy backend with the random-weight
tiny model: whatever the weights, a constrained request's output is in its grammar and finishes
with "stop". Many seeded samples against JSON schemas (enums, integer ranges, arrays, nested
objects), each parsed and validated with jsonschema (an independent validator); regex, choice,
Lark and GBNF grammars, json_object; LLM.generate and LLM.chat; n > 1; async scheduling; the
mask's numpy twin against a per-token loop; greedy constrained decoding against the reference
model's logits masked by a fresh matcher; the errors."""
from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.errors import InvalidRequestError
from tinyvllm.reference.sampling import apply_token_mask
from tinyvllm.structured import StructuredOutputsParams as SO
from tinyvllm.structured.mask import TokenMask

jsonschema = pytest.importorskip("jsonschema")

OPTIONS = dict(device="cpu", max_model_len=256)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["admin", "user", "guest"]},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "active"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": -5, "maximum": 5},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"enum": ["A1", "B2", "C3"]},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "shipping": {"type": "object", "properties": {"express": {"type": "boolean"},
                                                   "zone": {"enum": [1, 2, 3]}},
                 "required": ["express", "zone"], "additionalProperties": False}},
    "required": ["id", "items", "shipping"], "additionalProperties": False}
TAGS = {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 2,
        "maxItems": 4}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), **OPTIONS)


def constrained(so: SO, seed: int, temperature: float = 1.0, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    return SamplingParams(temperature=temperature, seed=seed, structured_outputs=so, **kw)


@pytest.mark.parametrize("schema", [PERSON, ORDER, TAGS], ids=["enum-range-bool", "nested-array", "top-array"])
def test_seeded_samples_parse_validate_and_stop(llm, schema):
    params = [constrained(SO(json=schema), seed) for seed in range(12)]
    params += [constrained(SO(json=json.dumps(schema)), 100, temperature=0)]      # the schema as text, greedy
    outs = llm.generate(["Give me the data:"] * len(params), params, use_tqdm=False)
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        jsonschema.validate(json.loads(o.text), schema)
    assert len({o.outputs[0].text for o in outs}) > 4, "random weights, different seeds: varied outputs"


def test_whitespace_is_allowed_when_asked(llm):
    """disable_any_whitespace=False lets the grammar take whitespace between JSON tokens. Every
    output, stopped or cut at max_tokens (free whitespace often uses them up), is the schema's
    document with whitespace added: removed (no string of this schema holds any), what is left is
    one of the compact documents the schema allows, or the start of one."""
    so = SO(json=TAGS, disable_any_whitespace=False)
    compact_docs = {json.dumps(list(c), separators=(",", ":"))
                    for n in range(2, 5) for c in itertools.product(("red", "green", "blue"), repeat=n)}
    outs = [out.outputs[0] for out in
            llm.generate(["x"] * 3, [constrained(so, s, max_tokens=60) for s in range(3)], use_tqdm=False)]
    assert any(re.search(r"\s", o.text) for o in outs)          # the whitespace was taken
    for o in outs:
        compact = "".join(o.text.split())
        if o.finish_reason == "stop":
            assert compact in compact_docs
            jsonschema.validate(json.loads(o.text), TAGS)
        else:
            assert o.finish_reason == "length" and any(doc.startswith(compact) for doc in compact_docs)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [(SO(regex=r"[a-z]{2,5}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
             (SO(choice=["yes", "no", "not sure"]), lambda t: t in ("yes", "no", "not sure")),
             (SO(grammar='start: "(" num ("+" num)* ")"\nnum: /[1-9]/'),
              lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
             (SO(grammar='root ::= "x=" [0-9] [0-9]?'), lambda t: re.fullmatch(r"x=[0-9]{1,2}", t)),   # GBNF
             (SO(json_object=True), lambda t: isinstance(json.loads(t), dict))]
    for so, check in cases:
        for out in llm.generate(["Answer:"] * 6, [constrained(so, s) for s in range(6)], use_tqdm=False):
            o = out.outputs[0]
            if so.json_object and o.finish_reason == "length":     # any object: may run long
                continue
            assert o.finish_reason == "stop" and check(o.text), (so.kind, o.text, o.finish_reason)


def test_chat_n_samples_and_a_mixed_batch(llm):
    so = SO(json=PERSON)
    out, = llm.chat([{"role": "user", "content": "Who are you?"}],
                    SamplingParams(n=3, max_tokens=120, seed=7, structured_outputs=so), use_tqdm=False)
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), PERSON)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(["Hello"], free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["Hello", "x", "y"], [free, constrained(so, 1), constrained(SO(regex="[0-9]{1,3}!"), 2)],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone            # unconstrained rows are untouched
    assert re.fullmatch("[0-9]{1,3}!", mixed[2].outputs[0].text)


def test_async_scheduling_gives_the_same_outputs(tiny_model_dir):
    """Constrained rows go ahead too, their masks made once their last tokens are in
    (structured/mask.py's PendingTokenMask); the outputs of a batch mixing them with plain rows
    are those of synchronous scheduling (tests/test_structured_async.py goes step by step)."""
    prompts = ["a", "b", "c", "d"]
    params = [SamplingParams(max_tokens=90, temperature=0.9, seed=3, ignore_eos=True),
              constrained(SO(json=ORDER), 4, max_tokens=80), constrained(SO(choice=["left", "right"]), 5),
              SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_model_dir), async_scheduling=async_scheduling, **OPTIONS)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                        for o in llm.generate(prompts, params, use_tqdm=False)])
        if async_scheduling:
            assert llm.engine.step_ahead.num_launched > 0
    assert results[0] == results[1]


def test_greedy_constrained_is_argmax_of_the_masked_reference_logits(llm):
    """Each greedy token is the argmax, over the tokens a fresh matcher allows, of the reference
    model's dense logits for the text so far."""
    import llguidance
    engine = llm.engine
    from tinyvllm.reference.model import ReferenceModel
    model = engine.runner.model
    assert isinstance(model, ReferenceModel)
    so = SO(json=PERSON)
    prompt = engine.tokenizer.encode("Data:")
    out = llm.generate([{"prompt_token_ids": prompt}], constrained(so, 0, temperature=0), use_tqdm=False)[0]
    got = out.outputs[0].token_ids
    matcher = llguidance.LLMatcher(engine.structured.ll_tokenizer, engine.structured.grammar(so))
    ids = list(prompt)
    for token in got:
        bits = np.frombuffer(matcher.compute_bitmask(), np.uint32)
        allowed = ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(-1)[:engine.model_config.vocab_size]
        logits = model.forward_full(np.asarray(ids, np.int32))[-1]
        assert token == int(np.argmax(np.where(allowed == 1, logits, -np.inf)))
        assert matcher.consume_token(token)
        ids.append(token)
    assert matcher.is_stopped() and out.outputs[0].finish_reason == "stop"


def test_numpy_mask_twin_against_a_loop():
    rng = np.random.default_rng(0)
    vocab, n = 77, 5
    logits = rng.standard_normal((n, vocab)).astype(np.float32)
    logits[1, 3] = np.nan
    bits = rng.integers(0, 2**32, (2, 3), dtype=np.uint64).astype(np.uint32).view(np.int32)
    mask = TokenMask(np.asarray([3, 1], np.int32), bits)
    expected = logits.copy()
    for j, row in enumerate(mask.rows):
        for t in range(vocab):
            if not (int(bits[j, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = -np.inf
    np.testing.assert_array_equal(apply_token_mask(logits.copy(), mask), expected)
    np.testing.assert_array_equal(apply_token_mask(logits.copy(), None), logits)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"json": PERSON, "regex": "a"}, "got json, regex"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "must be a JSON schema"),
    ({"regex": ""}, "non-empty string"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty list"),
    ({"grammar": "  "}, "non-empty string"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "true or false"),
])
def test_bad_params_are_one_clear_error(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SO(**kwargs)


def test_constraints_the_library_cannot_compile_are_refused_at_add_request(llm):
    for so, message in [(SO(regex="(ab"), "regex cannot be compiled"),
                        (SO(json={"type": "frobnicate"}), "json cannot be compiled"),
                        (SO(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "json cannot be compiled"),
                        (SO(grammar="start: undefined_rule"), "grammar cannot be compiled")]:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate(["x"], constrained(so, 0), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": PERSON})
