"""The real default model (SmolLM2-135M-Instruct, numpy backend) answering under a JSON schema:
the constraint holds the format, the model still supplies the answer."""
from __future__ import annotations

import json

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.structured import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

CAPITAL = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30},
                                            "capital": {"type": "string", "maxLength": 30}},
           "required": ["country", "capital"], "additionalProperties": False}


def test_default_model_answers_a_schema_constrained_question(default_model_home):
    from tinyvllm.checkpoint.default_model import DEFAULT_MODEL
    llm = LLM(str(default_model_home / "models" / DEFAULT_MODEL), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=CAPITAL))
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}], params,
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    answer = json.loads(out.text)
    jsonschema.validate(answer, CAPITAL)
    assert answer["capital"] == "Paris" and answer["country"].lower() == "france", answer
