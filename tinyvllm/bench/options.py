"""What `python -m tinyvllm bench` is asked to do: BenchOptions, and the command-line flags of the
engines compared with tinyvllm (kept apart from bench/run.py so that building the CLI's parser
imports no engine)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL_CACHE = Path("/tmp/tinyvllm-models")


@dataclass(frozen=True)
class BenchOptions:
    model: str | None = None           # a model directory; None = the preset's random model
    preset: str = "llama-3.2-1b"
    model_cache: Path = DEFAULT_MODEL_CACHE
    workload: str = "all"
    json_path: str | None = None
    compare_hf: bool = False
    hf_max_seconds: float = 180.0      # all HF runs together
    compare_vllm: bool = False
    vllm_site: str | None = None       # put first on the vLLM process's PYTHONPATH
    vllm_max_seconds: float = 900.0    # the vLLM process, start-up included
    engine_options: dict = field(default_factory=dict)   # EngineConfig fields the user set
    num_requests: int | None = None
    min_len: int | None = None
    max_len: int | None = None
    seed: int = 0


def add_comparison_arguments(parser) -> None:
    """`bench`'s flags for the engines run beside tinyvllm (read back by comparison_options)."""
    parser.add_argument("--compare-hf", action="store_true",
                        help="run the same workloads with HF transformers (needs torch, transformers)")
    parser.add_argument("--hf-max-seconds", type=float, default=180.0,
                        help="wall-time budget of all HF runs together (default 180)")
    parser.add_argument("--compare-vllm", action="store_true",
                        help="run the same workloads with vLLM's offline LLM, in a process of its own")
    parser.add_argument("--vllm-site", default=None, metavar="DIR",
                        help="directory vLLM is installed in, put first on the vLLM process's PYTHONPATH")
    parser.add_argument("--vllm-max-seconds", type=float, default=900.0,
                        help="wall-time limit of the vLLM process, start-up included (default 900)")


def comparison_options(args) -> dict:
    """The BenchOptions fields of add_comparison_arguments' flags."""
    names = ("compare_hf", "hf_max_seconds", "compare_vllm", "vllm_site", "vllm_max_seconds")
    return {name: getattr(args, name) for name in names}
