"""SamplingParams.validate(): every bad value is an InvalidRequestError naming its field."""
from __future__ import annotations

import math

import pytest

from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import InvalidRequestError


def test_defaults_are_valid_and_vllm_shaped():
    p = SamplingParams().validate()
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1.0, 1.0, -1, None, 16)
    assert p.stop_strings == [] and p.stop_token_id_set == frozenset() and not p.ignore_eos


def test_stop_normalisation():
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop_token_ids=None).validate().stop_token_id_set == frozenset()
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("temperature", True), ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", None),
    ("top_k", 2.5), ("top_k", "5"), ("top_k", None), ("seed", -1), ("seed", 2**64), ("seed", 1.0),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", None),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 5), ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]), ("stop_token_ids", 3), ("ignore_eos", "yes"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("kwargs", [dict(temperature=0), dict(top_p=1e-9), dict(top_k=0),
                                    dict(top_k=-1), dict(top_k=10**6), dict(seed=2**64 - 1),
                                    dict(stop=("a", "b")), dict(stop_token_ids=(1, 2))])
def test_edge_values_accepted(kwargs):
    SamplingParams(**kwargs).validate()


def test_params_are_frozen_and_checked_when_made():
    with pytest.raises(InvalidRequestError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.0), ("best_of", 3), ("presence_penalty", -2.01), ("presence_penalty", 2.01),
    ("frequency_penalty", math.nan), ("frequency_penalty", 3), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("repetition_penalty", math.inf), ("min_p", -0.1), ("min_p", 1.1),
    ("min_tokens", -1), ("min_tokens", 17), ("logprobs", 21), ("logprobs", -1), ("logprobs", 1.0),
    ("prompt_logprobs", 21), ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}), ("logit_bias", [1, 2]), ("skip_special_tokens", 1),
    ("include_stop_str_in_output", "no"),
])
def test_vllm_fields_invalid_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs", [dict(n=3), dict(best_of=2, n=2), dict(presence_penalty=-2),
                                    dict(frequency_penalty=2), dict(repetition_penalty=1e-3),
                                    dict(min_p=0), dict(min_p=1), dict(min_tokens=16),
                                    dict(logprobs=0), dict(logprobs=20), dict(prompt_logprobs=0),
                                    dict(logit_bias={0: -100, 7: 100.0})])
def test_vllm_fields_edge_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


def test_vllm_defaults():
    p = SamplingParams()
    assert (p.n, p.best_of, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
            p.min_tokens, p.logprobs, p.prompt_logprobs, p.skip_special_tokens,
            p.include_stop_str_in_output, p.logit_bias) == (1, None, 0.0, 0.0, 1.0, 0.0, 0, None,
                                                            None, True, False, None)
