"""Greedy agreement of tinyvllm's numpy backend with llama.cpp on the default model: the ids of
tests/fixtures/smollm2_llamacpp_golden.json (llama.cpp's greedy run of the Q4_1 file, see
benchmarks/llama_cpp_golden.py) against three ways tinyvllm runs the model:

    bf16         the bf16 conversion of the Q4_1 file (convert-gguf; `generate`'s default)
    FP8          that bf16 model with --quantization fp8
    Q4_1 blocks  `--model FILE.gguf`, the file's own blocks

    PYTHONPATH=. python benchmarks/llama_cpp_agreement.py

Per row: free-running (each side's own greedy ids fed back, 32 steps) the prompts whose ids are
all llama.cpp's and the first differing step of the others; teacher-forced (llama.cpp's ids fed,
every step a fresh comparison) the steps whose argmax is llama.cpp's id, and each divergence with
our gap (our top logit minus our logit of llama.cpp's id) and llama.cpp's own top-2 gap there.
For the blocks, 2 delta_t is the near-tie bound of tinyvllm/quant/llama_cpp_twin.py (the CI test,
tests/test_quant_llama_cpp.py, requires every divergence below it).
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "smollm2_llamacpp_golden.json"


def models():
    from tinyvllm.checkpoint.default_model import default_gguf_path, default_model_dir
    from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    from tinyvllm.reference.model import ReferenceModel
    bf16_dir, gguf = default_model_dir(), default_gguf_path()
    config, gguf_config = ModelConfig.from_pretrained(bf16_dir), ModelConfig.from_pretrained(gguf_model_dir(gguf))
    yield "bf16", ReferenceModel(config, load_weights(bf16_dir, config))
    yield "FP8", ReferenceModel(config, load_weights(bf16_dir, config, "fp8"))
    yield "Q4_1 blocks", ReferenceModel(gguf_config, load_gguf_blocks(gguf, gguf_config))


def compare(name: str, model, runs: list[dict]) -> list[str]:
    from tinyvllm.quant.llama_cpp_twin import teacher_forced
    identical, first, equal, steps, divergences = 0, [], 0, 0, []
    for i, run in enumerate(runs):
        theirs = run["generated_ids"]
        ours = model.greedy_generate(run["prompt_ids"], len(theirs))
        differ = next((s for s, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        identical += differ is None
        first += [] if differ is None else [f"prompt {i} at step {differ}"]
        if name == "Q4_1 blocks":
            forced = teacher_forced(model, run["prompt_ids"], theirs)
            logits, bound = forced.logits, 2 * forced.delta
        else:
            ids = np.asarray(run["prompt_ids"] + theirs[:-1], np.int32)
            logits, bound = model.forward_full(ids)[len(run["prompt_ids"]) - 1:], None
        for step, llama_id in enumerate(theirs):
            steps += 1
            top = int(logits[step].argmax())
            if top == llama_id:
                equal += 1
                continue
            gap = float(logits[step, top] - logits[step, llama_id])
            theirs_gap = run["top2_logit_gaps"][step]
            relation = "=" if run["runner_up_ids"][step] == top else ">="
            divergences.append(f"prompt {i} step {step}: our gap {gap:.4f}, llama.cpp's gap {relation} "
                               f"{theirs_gap:.4f}" + ("" if bound is None else f", 2 delta_t {bound[step]:.3f}"))
    return [f"| {name} | {identical}/{len(runs)}{' (' + '; '.join(first) + ')' if first else ''} | "
            f"{equal}/{steps} | {'<br>'.join(divergences) or '-'} |"]


def main() -> int:
    golden = json.loads(FIXTURE.read_text(encoding="utf-8"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    lines = [f"llama.cpp: {golden['oracle']}; tinyvllm: numpy backend, x86-64 CPU, "
             f"{datetime.date.today()}, {commit}", "",
             "| tinyvllm weights | free-running: prompts identical (first divergence) | teacher-forced: "
             "steps equal | teacher-forced divergences |", "|---|---|---|---|"]
    for name, model in models():
        lines += compare(name, model, golden["runs"])
        print(lines[-1], file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
