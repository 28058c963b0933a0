"""tinyvllm: a small, fast, readable LLM inference engine for Llama-architecture models."""
__version__ = "0.1.0"
