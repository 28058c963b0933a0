"""`--model FILE.gguf`: a GGUF file served at its own precision, its blocks kept.

The block-quantized tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) load as QuantizedWeight, views of the
memory-mapped file with nothing dequantized; float tensors (F32 norms, F16/BF16 matrices) load
as they are stored. Names and checks are convert-gguf's (checkpoint/gguf.py::tensor_map), and so
are the layout changes (checkpoint/gguf.py::hf_layout): llama's q/k row order, undone here on the
block rows (a row's blocks hold only that row's weights, so permuting rows permutes block rows;
tests/test_quant_gguf.py checks that it commutes with dequantization), and Gemma 3's norms.

Config and tokenizer come from the file's metadata exactly as convert-gguf makes them: the
directory it would write minus the weights (config.json, tokenizer.json, tokenizer_config.json,
generation_config.json) is written once into $TINYVLLM_HOME/gguf/<stem>-<digest of the path>/
and the engine reads them from there (checkpoint/default_model.py::converted_once, atomic, and
remade when the file's size or modification time changes).

`python -m tinyvllm convert-gguf FILE.gguf DIR` stays the way to a bf16 directory (it also
converts the block types not kept here: Q5_0, Q5_1, Q2_K, Q3_K, Q5_K).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.default_model import converted_once, tinyvllm_home
from tinyvllm.checkpoint.gguf_header import GGUF_MAGIC, open_gguf
from tinyvllm.checkpoint.gguf_tensors import FLOAT_TYPES, tensor_weight
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.block_format import QuantizedWeight
from tinyvllm.quant.weight_kinds import BLOCK_FORMATS


def is_gguf_file(model: str | Path | None) -> bool:
    """Is `model` a file that starts with GGUF's magic (rather than a model directory)?"""
    if model is None or not Path(model).is_file():
        return False
    try:
        with open(model, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError as e:
        raise ModelLoadError(f"cannot read {model}: {e.strerror}") from None


def gguf_model_dir(gguf_path: str | Path, home: Path | None = None) -> Path:
    """The directory of config and tokenizer files made from the GGUF file's metadata."""
    from tinyvllm.checkpoint.gguf import write_model_files
    path = Path(gguf_path).resolve()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    final = (home or tinyvllm_home()) / "gguf" / f"{path.stem}-{digest}"
    return converted_once(path, final, lambda source, out: write_model_files(open_gguf(source), out, str(source)),
                          "the GGUF file's config and tokenizer", {"source_mtime_ns": path.stat().st_mtime_ns})


def load_gguf_blocks(gguf_path: str | Path, config: ModelConfig) -> dict[str, QuantizedWeight | np.ndarray]:
    """Every tensor the model needs, by its Hugging Face name, in the file's own precision."""
    from tinyvllm.checkpoint.gguf import hf_layout, tensor_map
    source, reader = str(gguf_path), open_gguf(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    weights: dict[str, QuantizedWeight | np.ndarray] = {}
    for name, tensor in tensor_map(reader, config, source, arch).items():
        kind = tensor.tensor_type.name
        if kind not in BLOCK_FORMATS and kind not in FLOAT_TYPES:
            raise ModelLoadError(f"{source}: tensor {tensor.name!r} is {kind}; tinyvllm runs "
                                 f"{', '.join(BLOCK_FORMATS)} blocks as they are: convert the file to "
                                 "bf16 with `python -m tinyvllm convert-gguf FILE.gguf DIR` instead")
        weight = tensor_weight(tensor, source)
        if isinstance(weight, QuantizedWeight):
            weights[name] = QuantizedWeight(weight.format, weight.shape, hf_layout(weight.blocks, name, config, arch))
        else:
            weights[name] = hf_layout(weight, name, config, arch)
    return weights
