"""Host cost of structured outputs per constrained row per step: the token mask (structured/
mask.py's step_token_mask, all rows on llguidance's thread pool) and the matcher's advance with
the sampled token (Constraint.advance), for a batch of constrained rows walking random paths
through a JSON schema (enums, an integer range, a string array, a nested object).

    python benchmarks/structured_mask_bench.py MODEL_DIR [--rows 1,8,64] [--steps 40]
    python benchmarks/structured_mask_bench.py MODEL_DIR --compare     # llguidance vs outlines-core

    python benchmarks/structured_mask_bench.py MODEL_DIR --throughput cuda [--batch 64]

--throughput runs a batch of constrained requests (this schema, sampled, one seed each) and the
same batch unconstrained (ignore_eos, the same max_tokens) in one process, and prints the output
tok/s of each: what a constraint costs end to end on that device.

--compare walks one schema-valid document token by token with each grammar library installed
(mask, then consume) and prints compile time and the per-token cost: how the library was chosen
(structured/grammar.py's docstring has the numbers).
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

from tinyvllm.checkpoint.tokenizer import Tokenizer
from tinyvllm.config import ModelConfig
from tinyvllm.structured import StructuredOutputsParams
from tinyvllm.structured.grammar import GrammarCompiler
from tinyvllm.structured.mask import step_token_mask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace, the first programmer", "age": 36, "role": "admin",
            "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "12345"}}


def host_cost(model_dir: str, rows: int, steps: int, seed: int = 0) -> tuple[float, float]:
    """-> (mask us, advance us) per constrained row per step, medians over the steps."""
    config = ModelConfig.from_pretrained(model_dir)
    tokenizer = Tokenizer.from_pretrained(model_dir, config)
    compiler = GrammarCompiler(tokenizer, config.vocab_size, tokenizer.eos_token_ids)
    params = SimpleNamespace(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    seqs = [SimpleNamespace(constraint=None, num_cached_tokens=1, num_scheduled_tokens=0, token_ids=[0])
            for _ in range(rows)]
    compiler.attach(params, seqs)
    rng = np.random.default_rng(seed)
    mask_times, advance_times = [], []
    for _ in range(steps):
        live = [s for s in seqs if not s.constraint.matcher.is_stopped()]
        if not live:
            break
        start = time.perf_counter()
        mask = step_token_mask(live)
        mask_times.append((time.perf_counter() - start) / len(live))
        words = mask.bits.view(np.uint32)
        allowed = [np.flatnonzero(((w[:, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(-1)) for w in words]
        tokens = [int(rng.choice(a)) for a in allowed]
        start = time.perf_counter()
        for seq, token in zip(live, tokens):
            seq.constraint.advance(seq, token)
        advance_times.append((time.perf_counter() - start) / len(live))
    return float(np.median(mask_times)) * 1e6, float(np.median(advance_times)) * 1e6


def compare(model_dir: str) -> None:
    from tokenizers import Tokenizer as Backend
    backend = Backend.from_file(f"{model_dir}/tokenizer.json")
    config = ModelConfig.from_pretrained(model_dir)
    ids = backend.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False).ids
    eos = config.eos_token_ids[0]

    def walk(mask_into, consume) -> list[float]:
        out = []
        for t in ids:
            start = time.perf_counter()
            bits = mask_into()
            assert (int(bits[t >> 5]) >> (t & 31)) & 1, f"token {t} refused"
            consume(t)
            out.append(time.perf_counter() - start)
        return out

    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    start = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=config.vocab_size, eos_token=eos)
    made = time.perf_counter()
    m = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}))
    compiled = time.perf_counter()
    buf = allocate_token_bitmask(1, config.vocab_size)
    times = walk(lambda: (fill_next_token_bitmask(m, buf, 0), buf[0])[1], m.consume_token)
    report("llguidance", made - start, compiled - made, times)
    try:
        import outlines_core
    except ImportError:
        print("outlines-core: not installed")
        return
    from tinyvllm.checkpoint.gguf_tokenizer import byte_alphabet
    to_byte = {c: b for b, c in byte_alphabet().items()}
    special = {a.content for a in backend.get_added_tokens_decoder().values() if a.special}
    start = time.perf_counter()
    vocab: dict[bytes, list[int]] = {}
    for text, i in backend.get_vocab(with_added_tokens=False).items():
        if text not in special and i != eos and all(c in to_byte for c in text):
            vocab.setdefault(bytes(to_byte[c] for c in text), []).append(i)
    oc_vocab = outlines_core.Vocabulary(eos, vocab)
    made = time.perf_counter()
    guide = outlines_core.Guide(outlines_core.Index(
        outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), oc_vocab))
    compiled = time.perf_counter()
    bits = np.zeros((config.vocab_size + 31) // 32, np.int32)
    times = walk(lambda: (guide.write_mask_into(bits.ctypes.data, bits.size, 4), bits)[1], guide.advance)
    report("outlines-core", made - start, compiled - made, times)


def throughput(model_dir: str, device: str, batch: int, max_tokens: int = 128) -> None:
    from tinyvllm import LLM, SamplingParams
    llm = LLM(model_dir, device=device, max_model_len=1024)
    prompts = [f"Describe person number {i} as JSON:" for i in range(batch)]
    runs = {"unconstrained": [SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True) for i in range(batch)],
            "constrained": [SamplingParams(max_tokens=max_tokens, seed=i,
                                           structured_outputs=StructuredOutputsParams(json=SCHEMA))
                            for i in range(batch)]}
    llm.generate(prompts[:2], runs["constrained"][:2], use_tqdm=False)          # warm-up: compile, tokenizer
    for name, params in (*runs.items(), *runs.items()):                       # each twice, interleaved
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        stops = sum(o.outputs[0].finish_reason == "stop" for o in outs)
        print(f"{name:>13}: batch {batch}, {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s "
              f"({stops} finished by stop)")


def report(name: str, tokenizer_s: float, compile_s: float, times: list[float]) -> None:
    us = np.asarray(times) * 1e6
    print(f"{name}: tokenizer {tokenizer_s * 1e3:.0f} ms, compile {compile_s * 1e3:.0f} ms, {len(us)} tokens: "
          f"mask + consume per token mean {us.mean():.0f} us, median {np.median(us):.0f} us, max {us.max():.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--rows", default="1,8,64", help="constrained rows per step, comma-separated")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compare", action="store_true", help="llguidance against outlines-core instead")
    ap.add_argument("--throughput", metavar="DEVICE", help="constrained vs unconstrained output tok/s on DEVICE")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    if args.compare:
        return compare(args.model_dir)
    if args.throughput:
        return throughput(args.model_dir, args.throughput, args.batch)
    for rows in (int(r) for r in args.rows.split(",")):
        mask_us, advance_us = host_cost(args.model_dir, rows, args.steps)
        print(f"{rows:3d} constrained rows: mask {mask_us:7.1f} us + advance {advance_us:5.1f} us "
              f"per row per step (medians over {args.steps} steps)")


if __name__ == "__main__":
    main()
