"""tinyvllm: a small, fast, readable LLM inference engine for Llama-architecture models."""
__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "EngineConfig",
           "ModelConfig"]


def __getattr__(name):
    # The public API, imported on first use so `python -m tinyvllm --help` stays quick.
    if name == "LLM":
        from tinyvllm.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from tinyvllm.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "SamplingParams":
        from tinyvllm.engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from tinyvllm.structured.params import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "RequestOutput":
        from tinyvllm.engine.outputs import RequestOutput
        return RequestOutput
    if name in ("EngineConfig", "ModelConfig"):
        from tinyvllm import config
        return getattr(config, name)
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
