"""LLM: the offline batch API over LLMEngine, in vLLM's shape.

    llm = LLM(model="path/to/model", device="cpu")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}],
                        sampling_params=SamplingParams(n=2, temperature=0.8, seed=0))
    outs[0].outputs[1].text                  # prompt 0, sample 1
    llm.chat([{"role": "user", "content": "Hi!"}])
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from tinyvllm.checkpoint.tokenizer import Tokenizer
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.outputs import RequestOutput
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import InvalidRequestError, TinyVLLMError

DTYPES = {"cuda": ("auto", "bfloat16"), "cpu": ("auto", "float32")}   # the one type each backend computes in


class LLM:
    def __init__(self, model: str | Path | None = None, *, tokenizer: str | Path | None = None,
                 dtype: str = "auto", seed: int = 0, max_model_len: int | str | None = None,
                 gpu_memory_utilization: float = 0.90, enforce_eager: bool = False,
                 enable_prefix_caching: bool = True, device: str = "cuda", trace: bool | int = False,
                 chat_template: str | Path | None = None, **engine_options):
        """model: a Hugging Face model directory; None runs the default model (SmolLM2-135M-
        Instruct, checkpoint/default_model.py). tokenizer: only the model's own (its directory,
        or None). dtype: "auto", or the type the backend computes in (bfloat16 on cuda, float32
        on cpu). trace=True prints every kernel launch and cuBLAS call of the first TRACE_STEPS
        steps (an int: of that many steps) to stderr. Any other EngineConfig field (max_num_seqs,
        num_kv_blocks, generation_config, ...) is a keyword too."""
        if tokenizer is not None and (model is None or Path(tokenizer).resolve() != Path(model).resolve()):
            raise TinyVLLMError(f"tokenizer={str(tokenizer)!r}: only the model directory's own "
                                "tokenizer is supported (leave tokenizer unset)")
        if dtype not in DTYPES.get(device, ("auto",)):
            raise TinyVLLMError(f"dtype={dtype!r} is not supported on device {device!r}: use "
                                f"{' or '.join(DTYPES[device])} (tinyvllm computes in {DTYPES[device][1]} there)")
        if trace:
            from tinyvllm.trace import TRACE_STEPS
            engine_options.setdefault("trace_steps", TRACE_STEPS if trace is True else int(trace))
        options = dict(seed=seed, max_model_len=max_model_len, enforce_eager=enforce_eager,
                       enable_prefix_caching=enable_prefix_caching, device=device, **engine_options)
        if device == "cpu" and gpu_memory_utilization != 0.90:
            raise TinyVLLMError("gpu_memory_utilization sizes the GPU's KV cache; the cpu backend's "
                                "is set with kv_cache_gb or num_kv_blocks")
        options["gpu_memory_utilization"] = gpu_memory_utilization
        self.engine = LLMEngine(model, chat_template=chat_template, **options)
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use when given no SamplingParams: the model's
        generation_config.json defaults (engine option generation_config; see LLMEngine)."""
        return self.engine.get_default_sampling_params()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; -> one RequestOutput per
        prompt, in input order. A prompt is a str, {"prompt": str}, {"prompt_token_ids": [int]},
        or a list of those; sampling_params: one for all, or a list with one per prompt."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                                f"{type(p).__name__}")
        ids = self._add_all(prompts, params)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update()
        return [results[i] for i in ids]

    def _add_all(self, prompts, params) -> list[str]:
        """Add every request, or none: a bad one aborts those already added."""
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except TinyVLLMError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return ids

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | Path | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, rendered by
        the model's chat template (or `chat_template`, a file path or template text) and encoded
        as transformers' apply_chat_template does. chat_template_kwargs: extra template variables."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError(f"messages must be a conversation (a list of message dicts) or a list of "
                            f"conversations, got {_describe(messages)}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for c in conversations:
            if not isinstance(c, (list, tuple)) or not c or not all(isinstance(m, dict) for m in c):
                raise TypeError(f"each conversation must be a non-empty list of message dicts, got "
                                f"{_describe(c)}")
        tokenizer = self.get_tokenizer()
        prompts = [{"prompt_token_ids": tokenizer.encode_chat(list(c), add_generation_prompt, chat_template,
                                                              **(chat_template_kwargs or {}))}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _is_token_list(value) -> bool:
    return isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0 and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value)


def _one_prompt(p):
    """A prompt as LLMEngine.add_request takes it: a str or a list of token ids."""
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        keys = set(p)
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        if keys == {"prompt_token_ids"} and _is_token_list(p["prompt_token_ids"]):
            return [int(t) for t in p["prompt_token_ids"]]
        if keys == {"prompt_token_ids"} and isinstance(p["prompt_token_ids"], (list, tuple)) \
                and not p["prompt_token_ids"]:
            raise InvalidRequestError("prompt is empty")
        raise TypeError(f"a prompt dict must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
                        f"got {_describe(p)}")
    raise TypeError(f"a prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
                    f"got {_describe(p)}")


def _prompt_list(prompts) -> list:
    """generate()'s prompts argument as a list of add_request prompts."""
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise InvalidRequestError("no prompts given")
        if _is_token_list(prompts):
            raise TypeError("a bare list of token ids is ambiguous: pass {'prompt_token_ids': [...]} "
                            "(or a list of such dicts)")
        return [_one_prompt(p) for p in prompts]
    raise TypeError(f"prompts must be a str, a prompt dict, or a list of those, got {_describe(prompts)}")
