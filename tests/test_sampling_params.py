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
                                    dict(top_k=-5), dict(top_k=10**6), dict(seed=2**64 - 1),
                                    dict(stop=("a", "b")), dict(stop_token_ids=(1, 2))])
def test_edge_values_accepted(kwargs):
    SamplingParams(**kwargs).validate()
