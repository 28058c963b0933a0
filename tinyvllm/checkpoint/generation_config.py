"""Sampling defaults from a model's generation_config.json, as vLLM reads them with its
generation_config option:

    "auto"   the model directory's generation_config.json (vLLM's default)
    "vllm"   none: SamplingParams()'s own defaults
    DIR      the generation_config.json in another directory

Of the file's fields only those vLLM takes are used (get_diff_sampling_param): temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. A missing file means
no defaults; a field whose value the engine's check (SamplingParams) refuses is an error at
start-up, naming the file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from tinyvllm.errors import ModelLoadError, TinyVLLMError

FILENAME = "generation_config.json"
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def default_sampling_fields(model_dir: str | Path, option: str = "auto",
                            check: Callable[..., object] | None = None) -> dict:
    """The SamplingParams fields the generation config sets (may be empty); `check(**fields)`
    (the engine passes SamplingParams) raising a TinyVLLMError makes them an error naming the file."""
    if option == "vllm":
        return {}
    if option == "auto":
        path = Path(model_dir) / FILENAME
        if not path.is_file():
            return {}
    else:
        path = Path(option) / FILENAME
        if not path.is_file():
            raise TinyVLLMError(f"generation_config={option!r}: no {FILENAME} there (give 'auto', "
                                "'vllm' or a directory holding one)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read it: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    fields = {ours: config[theirs] for theirs, ours in FIELDS.items() if config.get(theirs) is not None}
    if check is not None:
        try:
            check(**fields)
        except TinyVLLMError as e:
            raise ModelLoadError(f"{path}: its sampling defaults are not usable: {e}") from None
    return fields
