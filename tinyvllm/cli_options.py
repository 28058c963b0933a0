"""The engine options every command that runs the engine shares (generate, bench, serve): the
EngineConfig fields settable from the command line, and the options dict they become."""
from __future__ import annotations

import argparse

from tinyvllm.errors import TinyVLLMError


# EngineConfig fields settable from the command line; unset flags keep EngineConfig's defaults.
def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (default) or cpu (the numpy reference backend)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step: one per decoding sequence, then prompt chunks")
    g.add_argument("--max-model-len", type=_int_or_auto, default=None, metavar="N|auto",
                   help="context limit (default: the model's max_position_embeddings; auto: that, "
                        "lowered with a warning to what the KV cache holds)")
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache size (default: --gpu-memory-utilization of the GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the GPU's memory the engine may use, weights and KV cache "
                        "together (default 0.9)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV cache size in blocks")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of prompt prefixes computed before (default: on)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before the previous one's tokens are read back, "
                        "hiding the host's per-step work (default: on for cuda, off for cpu)")
    g.add_argument("--no-fused-decode", dest="fused_decode", action="store_false", default=None,
                   help="cuda: decode with the nine-launch layer the guide follows, not the fused five")
    g.add_argument("--no-pdl", dest="pdl", action="store_false", default=None,
                   help="cuda: each kernel waits for the one before to end (no programmatic dependent launch)")
    g.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: a bf16 checkpoint's linears "
                   "quantized at load to FP8 e4m3, one scale per output row (an FP8 checkpoint needs no flag)")
    g.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="split every layer over N ranks (tinyvllm/parallel/; default 1)")


def _int_or_auto(text: str):
    try:
        return text if text == "auto" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def engine_options_from_args(args) -> dict:
    names = ("device", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_gb",
             "gpu_memory_utilization", "num_kv_blocks", "enforce_eager", "enable_prefix_caching",
             "async_scheduling", "fused_decode", "pdl", "quantization", "tensor_parallel_size")
    options = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if options.get("device") == "cpu" and "gpu_memory_utilization" in options:
        raise TinyVLLMError("--gpu-memory-utilization sizes the GPU's KV cache; the cpu backend's "
                            "is set with --kv-cache-gb or --num-kv-blocks")
    return options
