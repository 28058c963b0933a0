"""Record transformers' fp32 greedy tokens on the default model (SmolLM2-135M-Instruct converted
by tinyvllm) as the golden fixture tests/test_golden.py holds the engine to.

    python benchmarks/hf_golden.py --model-dir DIR [--gguf FILE.gguf] [--out tests/fixtures/smollm2_golden.json]

DIR is the directory `python -m tinyvllm convert-gguf FILE.gguf DIR` wrote. Needs torch and
transformers (nothing from tinyvllm); runs on cuda when there is one. What it records:

  cases           chat prompts (rendered and encoded by transformers' own apply_chat_template
                  from DIR's tokenizer_config) and raw prompts (transformers' tokenizer, special
                  tokens as it adds them): prompt ids, greedy ids (fp32 weights as converted,
                  fp32 maths, TF32 off, no EOS stop), and per step the top-2 ids, their logit gap,
                  and how far transformers' own bf16 run (teacher-forced on the same tokens)
                  moved that gap;
  chat_templates  text and ids of several conversations (system or not, multi-turn);
  tokenizer_cases ids of many strings (unicode, code, whitespace, special tokens);
  gguf_check      with --gguf and the `gguf` package importable: the same prompts through
                  transformers' own GGUF loader (its tokenizer and its dequantized fp32 weights),
                  an independent check of the conversion. Skipped, with the reason recorded,
                  when `gguf` is missing.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import sys
from pathlib import Path

MAX_NEW_TOKENS = 48
CHAT_CASES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi! My name is Ada."},
     {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
     {"role": "user", "content": "What is my name?"}],
    [{"role": "user", "content": "Explain what a GPU is in one sentence."}],
]
RAW_CASES = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
             "1, 2, 3, 4, 5,", "Les fleurs du printemps sont"]
TEMPLATE_CONVERSATIONS = [
    ([{"role": "user", "content": "Hello"}], True),
    ([{"role": "user", "content": "Hello"}], False),
    ([{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Tell me a joke."}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}], True),
    ([{"role": "user", "content": "Ünïcödé 日本語 😀\n\ttabs  and  spaces"}], True),
]
TOKENIZER_TEXTS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "Hello", " Hello", "hello  world   again",
    "The capital of France is", "12345 678 9", " 1 22 333 4444", "3.14159, 2.71828; 1e-5",
    "¡Hola! ¿Qué tal? Ça va très bien.", "Grüße aus München – schön!", "日本語のテキストです。",
    "中文测试，标点符号！", "한국어 문장입니다", "Привет, мир!", "مرحبا بالعالم", "😀🎉👍🏽 emoji 🧑‍🚀",
    "def f(x):\n    return x ** 2\n\nprint(f(3))", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>tail",
    "a<|im_end|>b<|im_start|>c", "<repo_name>foo<file_sep>bar", "<im_start> not special",
    "I'm you're they've we'll she'd it's", "DON'T STOP", "   leading", "trailing   ",
    "mixed\r\nline\rendings\n", "#!/bin/bash\necho \"$HOME\" | grep -v '^#'", "∑_{i=1}^{n} i² → ∞",
    "\u200b zero width \u00a0 nbsp", "a" * 200, "https://example.com/p?q=1&r=two#frag",
    "\x00\x01 control \x7f", "ﬁ ligature Å Å", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_model(torch, transformers, folder, dtype, device, **kwargs):
    """AutoModelForCausalLM in `dtype`, eager attention (plain maths), eval mode."""
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", **{key: dtype}, **kwargs)
    return model.to(device).eval()


def greedy(torch, model, prompt_ids, steps, device):
    """Greedy decoding with the KV cache, no EOS stop; per step the top-2 ids and their logit
    gap (fp32)."""
    out_ids, top2, gaps = [], [], []
    with torch.no_grad():
        step_input, past = torch.tensor([prompt_ids], device=device), None
        for _ in range(steps):
            out = model(step_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            values, indices = torch.topk(out.logits[0, -1].float(), 2)
            out_ids.append(int(indices[0]))
            top2.append([int(indices[0]), int(indices[1])])
            gaps.append(float(values[0] - values[1]))
            step_input = indices[:1].view(1, 1)
    return out_ids, top2, gaps


def teacher_forced_gaps(torch, model, prompt_ids, generated, top2, device):
    """The logit gap between the same two tokens at every step, the sequence given whole."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + generated[:-1]], device=device)
        logits = model(ids).logits[0, len(prompt_ids) - 1:].float()
    return [float(logits[i, a] - logits[i, b]) for i, (a, b) in enumerate(top2)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="the directory tinyvllm converted")
    p.add_argument("--gguf", default=None, help="the GGUF file it came from (for the cross-check)")
    p.add_argument("--out", default="tests/fixtures/smollm2_golden.json")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = p.parse_args(argv)
    import torch
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = Path(args.model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = load_model(torch, transformers, folder, torch.float32, device)
    model_bf16 = load_model(torch, transformers, folder, torch.bfloat16, device)

    def chat_ids(t, messages, add_generation_prompt=True):
        text = t.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids = t.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                    return_dict=True)["input_ids"]
        return text, list(ids)

    cases = []
    for i, messages in enumerate(CHAT_CASES):
        text, ids = chat_ids(tok, messages)
        cases.append({"name": f"chat-{i}", "kind": "chat", "messages": messages, "prompt_text": text,
                      "prompt_ids": ids})
    for i, prompt in enumerate(RAW_CASES):
        cases.append({"name": f"raw-{i}", "kind": "raw", "prompt_text": prompt,
                      "prompt_ids": tok(prompt).input_ids})
    for case in cases:
        ids, top2, gaps = greedy(torch, model, case["prompt_ids"], args.max_new_tokens, device)
        bf16 = teacher_forced_gaps(torch, model_bf16, case["prompt_ids"], ids, top2, device)
        case.update(generated_ids=ids, top2_ids=top2, top2_gap=gaps,
                    bf16_gap_error=[abs(b - g) for b, g in zip(bf16, gaps)],
                    text=tok.decode(ids, skip_special_tokens=True))
        print(f"{case['name']}: {len(case['prompt_ids'])} prompt ids, min gap {min(gaps):.4f}, "
              f"max bf16 gap error {max(case['bf16_gap_error']):.4f}: {case['text'][:60]!r}", file=sys.stderr)

    fixture = {
        "how_it_was_made": {
            "command": " ".join(["python", *sys.argv]), "transformers_version": transformers.__version__,
            "torch_version": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "dtype": "float32 (TF32 off), eager attention, greedy with KV cache, no EOS stop",
        },
        "converted_files_sha256": {name: sha256(folder / name) for name in
                                   ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")},
        "max_new_tokens": args.max_new_tokens,
        "cases": cases,
        "chat_templates": [dict(zip(("text", "ids"), chat_ids(tok, m, g)), messages=m, add_generation_prompt=g)
                           for m, g in TEMPLATE_CONVERSATIONS],
        "tokenizer_cases": [{"text": t, "ids": tok(t).input_ids} for t in TOKENIZER_TEXTS],
        "gguf_check": gguf_check(torch, transformers, args, cases, device, chat_ids, tok),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def gguf_check(torch, transformers, args, cases, device, chat_ids, dir_tok) -> dict:
    """transformers' own reading of the GGUF file: the same prompts through its tokenizer (needs
    the `gguf` package), the same greedy decoding on its fp32 dequantized weights, not rounded to
    bf16 (needs `accelerate` too). A missing package skips its part, the reason recorded."""
    if not args.gguf:
        return {"skipped": "no --gguf given"}
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        print("gguf cross-check skipped: the `gguf` package is not installed", file=sys.stderr)
        return {"skipped": "the gguf package is not installed"}
    path = Path(args.gguf)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    result = {"gguf_file": path.name, "gguf_sha256": sha256(path), "cases": [],
              "tokenizer_cases_equal": all(tok(t).input_ids == dir_tok(t).input_ids for t in TOKENIZER_TEXTS),
              "chat_templates_equal": all(chat_ids(tok, m, g) == chat_ids(dir_tok, m, g)
                                          for m, g in TEMPLATE_CONVERSATIONS)}
    model = None
    if importlib.util.find_spec("accelerate") is None:   # transformers' GGUF model loading needs it
        result["model_skipped"] = "the accelerate package is not installed"
    else:
        model = load_model(torch, transformers, path.parent, torch.float32, device, gguf_file=path.name)
    for case in cases:
        ids = chat_ids(tok, case["messages"])[1] if case["kind"] == "chat" else tok(case["prompt_text"]).input_ids
        entry = {"name": case["name"], "prompt_ids_equal": ids == case["prompt_ids"], "prompt_ids": ids}
        if model is not None:       # on our prompt ids: this compares the weights alone
            generated = greedy(torch, model, case["prompt_ids"], len(case["generated_ids"]), device)[0]
            first = next((i for i, (a, b) in enumerate(zip(generated, case["generated_ids"])) if a != b), None)
            entry.update(generated_ids=generated, first_difference=first,
                         gap_there=None if first is None else case["top2_gap"][first])
        result["cases"].append(entry)
        print(f"gguf {case['name']}: prompt ids equal {entry['prompt_ids_equal']}, first generated "
              f"difference at {entry.get('first_difference', 'n/a')}", file=sys.stderr)
    print(f"gguf tokenizer cases equal {result['tokenizer_cases_equal']}, chat templates equal "
          f"{result['chat_templates_equal']}", file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(main())
