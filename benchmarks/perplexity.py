"""Perplexity of the default model (SmolLM2-135M-Instruct) over a fixed text in the repo, in each
precision tinyvllm runs it, and llama.cpp's own perplexity of the same file over the same tokens.

    PYTHONPATH=. python benchmarks/perplexity.py [--tokens 512] [--llama-python /work/venvs/llama/bin/python]

The text: the first --tokens tokens of docs/guide.md, encoded by the default model's tokenizer
(no BOS: SmolLM2's file adds none); their sha256 is printed, so a change of the guide's opening
shows. Perplexity = exp(mean over t = 1..N-1 of -log p(x_t | x_<t)), one window of N tokens, every
position but the first scored, log-softmax in float64 over float32 logits.

Rows (numpy backend; tinyvllm's engine runs the same weights):
    bf16         the bf16 conversion of the Q4_1 file (convert-gguf; what `generate` runs by default)
    FP8          that bf16 model with --quantization fp8 (e4m3, a scale per output row)
    Q4_1 blocks  `--model FILE.gguf`: the file's own blocks (tinyvllm/quant/block_format.py::linear),
                 and twice more with the linear swapped (tinyvllm/quant/llama_cpp_twin.py): exact
                 (float32 activations times the file's float32 values) and llama.cpp's rounding
    llama.cpp    llama-cpp-python on the same file, fed the same token ids (its own CPU kernels:
                 8-bit activations, fp16 KV cache), when a python with llama_cpp is given
The model has no original bf16 weights here: every row but FP8 computes with the Q4_1 file's
values (bf16 rounds them to 8 significant bits), so the rows differ by arithmetic alone.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "docs" / "guide.md"


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:-1] (float64)."""
    z = np.asarray(logits[:-1], np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return math.exp(-float(np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]])))


def llama_cpp_worker(gguf: str, ids_json: str, threads: int) -> None:
    """Runs under a python that has llama_cpp (and only numpy besides): prints its perplexity."""
    import llama_cpp
    ids = json.loads(ids_json)
    llm = llama_cpp.Llama(gguf, n_ctx=len(ids), n_batch=len(ids), n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    print(json.dumps({"perplexity": perplexity(logits, ids), "version": llama_cpp.__version__}))


def numpy_rows(ids: list[int]) -> list[tuple[str, float, float]]:
    """(row, perplexity, seconds) for bf16, FP8 and Q4_1 blocks on the numpy backend, and the Q4_1
    blocks with the linear swapped for the exact product and for llama.cpp's rounding (twin)."""
    from tinyvllm.checkpoint.default_model import default_gguf_path, default_model_dir
    from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import EngineConfig, ModelConfig
    from tinyvllm.engine.runners import make_runner
    from tinyvllm.quant.llama_cpp_twin import exact_linear, llama_cpp_linear
    bf16_dir, gguf = default_model_dir(), default_gguf_path()
    config = ModelConfig.from_pretrained(bf16_dir)
    gguf_config = ModelConfig.from_pretrained(gguf_model_dir(gguf))
    loads = [("bf16", config, lambda: load_weights(bf16_dir, config), {}),
             ("FP8 (--quantization fp8)", config, lambda: load_weights(bf16_dir, config, "fp8"), {}),
             ("Q4_1 blocks (--model FILE.gguf)", gguf_config, lambda: load_gguf_blocks(gguf, gguf_config),
              {"Q4_1 blocks, exact: float32 weights and activations": exact_linear,
               "Q4_1 blocks, llama.cpp's 8-bit activations (numpy twin)": llama_cpp_linear})]
    rows = []
    for name, cfg, load, variants in loads:
        runner = make_runner(cfg, load(), EngineConfig(device="cpu", num_kv_blocks=1))
        for row, linear in [(name, None), *variants.items()]:
            if linear is not None:
                runner.model.linear = linear          # the numpy backend's reference model
            start = time.perf_counter()
            rows.append((row, perplexity(runner.prompt_logits(ids), ids), time.perf_counter() - start))
            print(f"{row}: {rows[-1][1]:.4f} ({rows[-1][2]:.1f} s)", file=sys.stderr)
        runner.close()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="N: the window scored")
    parser.add_argument("--llama-python", default=None,
                        help="a python with llama-cpp-python installed (e.g. /work/venvs/llama/bin/python)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp-worker", nargs=2, metavar=("GGUF", "IDS_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llama_cpp_worker:
        llama_cpp_worker(*args.llama_cpp_worker, args.threads)
        return 0
    from tinyvllm.checkpoint.default_model import default_gguf_path, default_model_dir
    from tinyvllm.checkpoint.tokenizer import Tokenizer
    from tinyvllm.config import ModelConfig
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir, ModelConfig.from_pretrained(model_dir))
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:args.tokens]
    if len(ids) < args.tokens:
        parser.error(f"{TEXT} has only {len(ids)} tokens")
    digest = hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16]
    rows = numpy_rows(ids)
    if args.llama_python:
        done = subprocess.run([args.llama_python, __file__, "--threads", str(args.threads), "--llama-cpp-worker",
                               str(default_gguf_path()), json.dumps(ids)], capture_output=True, text=True)
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            return 1
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append((f"llama.cpp (llama-cpp-python {result['version']}, Q4_1 file)", result["perplexity"], None))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    print(f"Perplexity of {ModelConfig.from_pretrained(model_dir).num_parameters:,}-parameter SmolLM2-135M-Instruct "
          f"over the first {len(ids)} tokens of docs/guide.md (token ids sha256 {digest}); "
          f"{platform.machine()} CPU, numpy backend, {datetime.date.today()}, {commit}\n")
    print("| weights | perplexity | seconds |\n|---|---|---|")
    for name, value, seconds in rows:
        print(f"| {name} | {value:.4f} | {'' if seconds is None else f'{seconds:.1f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
