"""The package's public names resolve to the real classes (imported lazily)."""
import pytest

import tinyvllm


def test_public_api_names():
    from tinyvllm.config import EngineConfig, ModelConfig
    from tinyvllm.engine.llm import LLM
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.engine.outputs import RequestOutput
    from tinyvllm.engine.sampling_params import SamplingParams
    from tinyvllm.structured import StructuredOutputsParams
    assert tinyvllm.StructuredOutputsParams is StructuredOutputsParams
    assert (tinyvllm.LLM, tinyvllm.LLMEngine, tinyvllm.SamplingParams, tinyvllm.RequestOutput,
            tinyvllm.EngineConfig, tinyvllm.ModelConfig) == (LLM, LLMEngine, SamplingParams,
                                                              RequestOutput, EngineConfig, ModelConfig)
    assert set(tinyvllm.__all__) == {"LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams",
                                     "RequestOutput", "EngineConfig", "ModelConfig"}


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        tinyvllm.Nope  # noqa: B018
