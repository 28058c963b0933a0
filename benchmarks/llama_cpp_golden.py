"""Greedy token ids of the default model's Q4_1 file as llama.cpp computes them: the oracle for
tinyvllm's native GGUF path. Writes tests/fixtures/smollm2_llamacpp_golden.json.

    pip install llama-cpp-python==0.3.36        # a source build: cmake + a C++ compiler
    PYTHONPATH=. python benchmarks/llama_cpp_golden.py [--gguf FILE] [--steps 32]

Greedy without sampling: each prompt's token ids are fed with Llama.eval (logits_all, without
which eval keeps no logits), the next id is the
argmax of the last position's logits (numpy, ties to the lowest id), fed back, and so on, for a
fixed number of steps (end-of-turn ids do not stop it: compare with ignore_eos). The
fixture keeps, per step, the chosen id, the runner-up id and the gap between their logits: a
later comparison forgives a divergence only at a step whose gap is within the bound below.
The prompts are fixed texts tokenized by llama.cpp itself (special tokens parsed, no BOS, as
SmolLM2's file asks); their ids are stored, so a comparison feeds ids and needs no tokenizer.

Where llama.cpp's CPU path rounds, and the near-tie bound that follows (for the comparison):

1. Activations to 8 bits. Before a quantized matrix multiplies x, llama.cpp quantizes x in
   blocks of 32 to the matrix type's partner: Q8_1 for Q4_1 weights (every layer matrix of this
   file), Q8_0 for Q8_0 weights (the embedding, tied to the LM head). For a block b:
       D_b = fp32 amax_b / 127, stored as fp16: D_b' = D_b (1 + e), |e| <= 2^-11
       q_i = round(x_i / D_b)                   (int8, |q_i| <= 127), so |D_b q_i - x_i| <= D_b / 2
       Q8_1 also stores s_b = fp16(D_b * sum_i q_i)
   and the dot product with a Q4_1 block (d, m, codes c) is computed as
       d D_b' sum_i c_i q_i + m s_b             (the integer sum exact; float32 after)
   against the exact sum_i (d c_i + m) x_i. Per block the difference is at most
       sum_i |d c_i| (D_b/2 + 2^-11 (|x_i| + D_b/2)) + |m| (32 D_b/2 + 2^-11 |D_b sum_i q_i|)
   which is about (D_b / 2) sum_i |w_i|: half a step of 1/127 of the block's largest activation,
   weighted by the weights' magnitudes. For Q8_0 x Q8_0 (the LM head) drop the m term and
   widen |d c_i| to |d q_w,i|.
2. Attention in fp16: the KV cache is F16 (llama.cpp's default type_k/type_v) and the
   non-flash path converts q and the softmax probabilities to F16 for their products (relative
   2^-11 each, below the 8-bit rounding of step 1 and below tinyvllm's bf16 storage, 2^-8).
3. Float32 accumulation in an order of its own (SIMD lanes, threads): relative gamma_k 2^-24,
   negligible beside the above.

The bound. Step 1 at the LM head alone moves logit v by at most B_v(h) (the sum above over the
blocks of the final normed hidden state h and embedding row v), computable at each step from h.
The same rounding at the input of every earlier linear layer moves h itself; a worst case
through 30 layers of attention and SiLU is useless, so the comparison measures it instead: the
reference model run on the common prefix twice, plain and with every linear input rounded as
step 1 says (a numpy twin of llama.cpp's Q8_1/Q8_0 quantization of activations), gives the
step's logit perturbation delta_t = max_v |logits_rounded_v - logits_plain_v|. If the two
implementations' logits differ by at most delta_t per token, their argmaxes can differ only where
the top-2 gap is at most 2 delta_t (each of the two logits moving delta_t towards the other): a
divergence at a step with gap <= 2 delta_t (plus bf16's own share, measured the same way with
bf16 rounding switched on) is a near-tie; any other divergence is a bug. After the first
divergence the sequences no longer share a prefix, so only the ids up to it are compared.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "smollm2_llamacpp_golden.json"
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Write a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village",
]
LLAMA_CPP_VERSION = "0.3.36"


def greedy(llm, prompt_ids: list[int], steps: int) -> dict:
    """Feed the prompt, then `steps` times: argmax of the last logits, fed back."""
    llm.reset()
    llm.eval(prompt_ids)
    ids, second, gaps = [], [], []
    for _ in range(steps):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        order = np.argsort(-logits, kind="stable")[:2]
        ids.append(int(order[0]))
        second.append(int(order[1]))
        gaps.append(float(logits[order[0]] - logits[order[1]]))
        llm.eval([ids[-1]])
    return {"generated_ids": ids, "runner_up_ids": second, "top2_logit_gaps": gaps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the default model's)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args(argv)
    import llama_cpp
    if llama_cpp.__version__ != LLAMA_CPP_VERSION:
        print(f"llama-cpp-python {llama_cpp.__version__} found; the fixture is made with "
              f"{LLAMA_CPP_VERSION}", file=sys.stderr)
        return 1
    path = args.gguf
    if path is None:
        from tinyvllm.checkpoint.default_model import default_gguf_path
        path = default_gguf_path()
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=args.threads, n_threads_batch=args.threads,
                          seed=0, logits_all=True, verbose=False)
    runs = []
    for text in PROMPTS:
        prompt_ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        runs.append({"prompt": text, "prompt_ids": list(map(int, prompt_ids)),
                     **greedy(llm, prompt_ids, args.steps)})
        print(f"{text[-40:]!r}: min top-2 gap {min(runs[-1]['top2_logit_gaps']):.4f}")
    golden = {
        "model_file": path.name, "model_file_bytes": path.stat().st_size,
        "oracle": f"llama-cpp-python {llama_cpp.__version__}, CPU, {args.threads} threads, "
                  "n_ctx 512, KV cache F16, no flash attention",
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "decoding": "greedy: argmax of the last position's logits, fed back; no BOS; "
                    f"{args.steps} steps, end-of-turn ids do not stop it",
        "runs": runs,
    }
    runs_text = ",\n  ".join(json.dumps(run) for run in runs)      # one line per run
    text = json.dumps({**golden, "runs": []}, indent=1).replace('"runs": []', f'"runs": [\n  {runs_text}\n ]')
    args.out.write_text(text + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
