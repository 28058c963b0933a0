"""LLM: the offline batch API over LLMEngine (generate / chat)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from tinyvllm.checkpoint.tokenizer import Tokenizer
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.outputs import RequestOutput
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.errors import InvalidRequestError, TinyVLLMError


class LLM:
    """Offline generation: LLM(model_dir, **engine_options).generate(prompts, params).
    LLM() with no model_dir runs the default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model_dir: str | Path | None = None, *, trace: bool | int = False, **engine_options):
        """model_dir None: the default model (checkpoint/default_model.py). trace=True prints
        every kernel launch and cuBLAS call of the first TRACE_STEPS steps (an int: of that many
        steps) to stderr; the same as engine option trace_steps."""
        if trace:
            from tinyvllm.trace import TRACE_STEPS
            engine_options.setdefault("trace_steps", TRACE_STEPS if trace is True else int(trace))
        self.engine = LLMEngine(model_dir, **engine_options)
        self._next_id = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; -> outputs in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequestError("no prompts given")
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        ids = self._add_all(prompts, params)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
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

    def chat(self, messages: list[dict] | list[list[dict]], params=None, use_tqdm: bool = False, *,
             chat_template: str | Path | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, rendered by
        the model's chat template (or `chat_template`, a file path or template text) and encoded
        as transformers' apply_chat_template does. chat_template_kwargs: extra template variables."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt, chat_template,
                                              **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(prompts, params, use_tqdm)
