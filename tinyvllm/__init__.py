"""tinyvllm: a small, fast, readable LLM inference engine for Llama-architecture models."""
__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "EngineConfig", "ModelConfig"]


def __getattr__(name):
    # The public API, imported on first use so `python -m tinyvllm --help` stays quick.
    if name in ("LLM", "LLMEngine"):
        from . import engine
        return getattr(engine, name)
    if name == "SamplingParams":
        from .sampling_params import SamplingParams
        return SamplingParams
    if name == "RequestOutput":
        from .sequence import RequestOutput
        return RequestOutput
    if name in ("EngineConfig", "ModelConfig"):
        from . import config
        return getattr(config, name)
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
