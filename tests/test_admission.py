"""Admission limits (tinyvllm/engine/limits.py) at LLMEngine.add_request: every value past what
the arrays and kernels hold is an InvalidRequestError naming the field and its range, raised
before the engine changes; the boundary values themselves are served."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tinyvllm.engine import limits
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import InvalidRequestError

VOCAB = 128256
DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, device="cpu", num_kv_blocks=32, max_model_len=256, max_num_seqs=8)


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 2, **fields})


@pytest.mark.parametrize("fields, message", [
    (dict(top_k=2**31), r"top_k=2147483648: must be an integer in \[-1, 2147483647\] \(int32\)"),
    (dict(seed=2**64), r"seed=18446744073709551616"),
    (dict(max_tokens=2**31), r"max_tokens=2147483648: must be an integer in \[1, 2147483647\]"),
    (dict(temperature=1e39), r"temperature=1e\+39: must be a finite float32"),
    (dict(stop=[f"s{i}" for i in range(limits.MAX_STOP_STRINGS + 1)]), r"stop=.*at most 16 stop strings"),
    (dict(stop="x" * (limits.MAX_STOP_STRING_CHARS + 1)), r"stop=.*at most 512 characters"),
    (dict(stop_token_ids=list(range(limits.MAX_STOP_TOKEN_IDS + 1))), r"stop_token_ids=.*at most 1024"),
    (dict(stop_token_ids=[VOCAB]), rf"stop_token_ids=\[{VOCAB}\]: token ids must be in \[0, {VOCAB - 1}\]"),
])
def test_values_past_the_limits_are_refused_naming_the_field(engine, fields, message):
    free = engine.num_free_blocks
    with pytest.raises(InvalidRequestError, match="invalid sampling parameter " + message):
        engine.add_request("r", "Hello", params(**fields))
    assert not engine.has_unfinished_requests() and engine.num_free_blocks == free


@pytest.mark.parametrize("fields", [
    dict(top_k=2**31 - 1, temperature=0.7), dict(top_k=-1, temperature=0.7), dict(seed=2**64 - 1, temperature=0.7),
    dict(temperature=limits.FLOAT32_MAX), dict(max_tokens=2**31 - 1, stop_token_ids=[VOCAB - 1]),
    dict(stop=[f"s{i}" for i in range(limits.MAX_STOP_STRINGS)]), dict(stop="y" * limits.MAX_STOP_STRING_CHARS),
])
def test_boundary_values_are_served(engine, fields):
    engine.add_request("b", [1000] * 250, params(**fields))     # max_tokens: the context stops it
    finals = []
    while engine.has_unfinished_requests():
        finals += [o.outputs[0] for o in engine.step() if o.finished]
    (out,) = finals
    assert out.finish_reason in ("length", "stop") and out.error is None
    assert all(0 <= t < VOCAB for t in out.token_ids)
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_a_prompt_too_long_to_fit_any_tokenization_is_refused_before_tokenizing(engine):
    assert engine.max_prompt_bytes == 256 * 256      # the context x the longest token's UTF-8 bytes
    huge = "lorem ipsum " * 350_000                  # 4.2 MB: seconds of tokenization
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=r"prompt is 4200000 bytes of UTF-8: more than any "
                                                  r"text that fits the context \(65536 bytes at most\)"):
        engine.add_request("h", huge, params())
    assert time.perf_counter() - start < 0.5
    with pytest.raises(InvalidRequestError, match="context limit is 256"):   # under the bound: tokenized
        engine.add_request("h", "lorem ipsum " * 1000, params())
    with pytest.raises(InvalidRequestError, match=r"not valid Unicode: surrogates not allowed at character 3"):
        engine.add_request("u", "abc\udfffdef", params())


def test_docs_limits_table_is_the_limits_table():
    text = DOCS.read_text()
    rows = re.findall(r"^\| `([^`]+)` \| (.+?) \| (.+?) \| (.+?) \|$", text, re.M)
    assert rows == [(lim.field, lim.low, lim.high, lim.why) for lim in limits.LIMITS]


@pytest.mark.parametrize("prompt, message", [
    ([1, True], "a token-id prompt must be a list of integers"),
    ([1, 2.0], "a token-id prompt must be a list of integers"),
    ([5, "6"], "a token-id prompt must be a list of integers"),
    ([-1, 2], re.escape(f"prompt token ids must be in [0, {VOCAB})")),
    ([5, VOCAB], re.escape(f"prompt token ids must be in [0, {VOCAB})")),
    ([], "prompt is empty"),
])
def test_token_id_prompts_are_checked_on_every_path(engine, prompt, message):
    """A plain list of ints takes intake.prompt_ids' fast path (C-level type and range checks),
    anything else the general one; both refuse the same prompts with the same error, and keep
    the ids they accept unchanged (a tuple and a numpy array go the general path)."""
    import numpy as np

    from tinyvllm.engine.intake import prompt_ids
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", prompt, params())
    assert not engine.has_unfinished_requests()
    ids = [0, 17, VOCAB - 1]
    for form in (ids, tuple(ids), np.array(ids, np.int64)):
        assert prompt_ids(form, engine.tokenizer, VOCAB, None) == (None, ids)
