"""`python -m tinyvllm <command>`: make-model, generate, inspect, bench, serve.

Each command lives in its own function; user errors (TinyVLLMError) become one line on stderr
and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import sys

from tinyvllm import __version__
from tinyvllm.cli_options import add_engine_options, engine_options_from_args  # noqa: F401  (importers)
from tinyvllm.errors import TinyVLLMError


def _cmd_make_model(args) -> int:
    import time
    start = time.perf_counter()
    if args.gguf is not None:
        from tinyvllm.checkpoint.preset_gguf import write_gguf_model
        path = write_gguf_model(args.out, args.preset, args.gguf, seed=args.seed)
        print(f"wrote {args.preset} as {args.gguf} GGUF (random weights) to {path} "
              f"in {time.perf_counter() - start:.1f} s")
        return 0
    from tinyvllm.checkpoint.model_writer import write_model
    path = write_model(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} model to {path}")
    return 0


def _cmd_convert_gguf(args) -> int:
    import time

    from tinyvllm.checkpoint.gguf import convert_gguf
    start = time.perf_counter()
    path = convert_gguf(args.gguf, args.out)
    print(f"converted {args.gguf} to {path} in {time.perf_counter() - start:.1f} s")
    return 0


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise TinyVLLMError(f"cannot read prompt file {args.file}: {e.strerror}") from None
    if not prompts:
        raise TinyVLLMError("no prompt given: pass PROMPT arguments or --file FILE")
    return prompts


def _cmd_generate(args) -> int:
    """Stream one prompt's tokens as they come; for many prompts show a progress bar (or, with
    --stream, stream them one after another in input order) and print each result."""
    import time

    from tqdm import tqdm

    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                            min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty).validate()
    prompts = _read_prompts(args)
    options = engine_options_from_args(args)
    if args.scheduling is not None:
        options["scheduling"] = args.scheduling
    if args.trace or args.trace_steps is not None:
        from tinyvllm.trace import TRACE_STEPS
        options["trace_steps"] = TRACE_STEPS if args.trace_steps is None else args.trace_steps
    engine = LLMEngine(args.model, chat_template=args.chat_template, **options)
    if args.chat or args.system is not None or args.chat_template is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompts_in = [engine.tokenizer.encode_chat(system + [{"role": "user", "content": p}])
                      for p in prompts]
    else:
        prompts_in = prompts
    ids = [str(i) for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts_in):
        engine.add_request(request_id, prompt, params)

    stream, many = args.stream or len(ids) == 1, len(ids) > 1
    header = lambda i: f"--- [{i + 1}/{len(ids)}] {prompts[i][:60]!r}\n" if many else ""
    finals, pending, cursor = {}, {i: [] for i in ids}, 0
    bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not many or stream)
    if stream:
        sys.stdout.write(header(0))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream:                     # (reading delta_text costs a detokenization)
                pending[out.request_id].append(out.outputs[0].delta_text)
            if out.finished:
                finals[out.request_id] = out
                bar.update()
        while stream and cursor < len(ids):           # print in input order, as far as done
            sys.stdout.write("".join(pending[ids[cursor]]))
            pending[ids[cursor]].clear()
            if ids[cursor] not in finals:
                break
            cursor += 1
            sys.stdout.write("\n" + (header(cursor) if cursor < len(ids) else ""))
        sys.stdout.flush()
    bar.close()
    elapsed = time.perf_counter() - start
    outputs = [finals[i] for i in ids]
    if not stream:
        for i, out in enumerate(outputs):
            sys.stdout.write(f"{header(i)}{out.outputs[0].text}\n")
    generated = sum(o.outputs[0].num_generated_tokens for o in outputs)
    ttfts = [t for o in outputs if (t := o.metrics.time_to_first_token) is not None]
    print(f"{len(outputs)} requests, {sum(o.num_prompt_tokens for o in outputs)} prompt tokens, "
          f"{generated} generated tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s), "
          f"mean TTFT {1000 * sum(ttfts) / max(len(ttfts), 1):.1f} ms, "
          f"{engine.num_preemptions} preemptions{_prefix_cache_summary(engine)}", file=sys.stderr)
    engine.close()
    return 0


def _prefix_cache_summary(engine) -> str:
    if not engine.engine_config.enable_prefix_caching:
        return ""
    stats = engine.prefix_cache_stats
    return f", prefix cache hits {stats.hits}/{stats.queries} tokens ({stats.hit_rate:.0%})"


def _cmd_inspect(args) -> int:
    from tinyvllm.engine.llm_engine import make_engine_config
    from tinyvllm.model_report import inspect_report
    names = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "quantization",
             "tensor_parallel_size")
    config = make_engine_config(None, {n: getattr(args, n) for n in names if getattr(args, n) is not None})
    print(inspect_report(args.model, config))
    return 0


def _cmd_bench(args) -> int:
    from tinyvllm.bench.options import BenchOptions, comparison_options
    from tinyvllm.bench.run import run_bench
    options = engine_options_from_args(args)
    run_bench(BenchOptions(
        model=args.model, preset=args.preset, model_cache=args.model_cache, workload=args.workload,
        json_path=args.json, engine_options=options, num_requests=args.num_requests, min_len=args.min_len,
        max_len=args.max_len, seed=args.seed, **comparison_options(args)))
    return 0


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line, like every other tinyvllm error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from tinyvllm.bench.options import add_comparison_arguments
    from tinyvllm.checkpoint.default_model import DEFAULT_MODEL
    from tinyvllm.checkpoint.model_writer import PRESET_NAMES
    default_help = f"Hugging Face model directory or GGUF file (default: {DEFAULT_MODEL}, converted once to bf16)"
    p = _Parser(prog="tinyvllm", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"tinyvllm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a random-weight Llama model in HF layout "
                                           f"(or, --preset {DEFAULT_MODEL}, the real default model)")
    mm.add_argument("out", help="output directory")
    mm.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--gguf", metavar="TYPE", default=None,
                    help="write only OUT/model.gguf, not the Hugging Face files: random weights (also "
                         f"for {DEFAULT_MODEL}: of its shapes) laid out as llama.cpp lays them out, matrices "
                         "in TYPE (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, F16, F32; Q4_K/Q6_K blocks drawn at random, "
                         "gguf cannot quantize them), the LM head's Q8_0 beside a 4-bit TYPE, norms F32, "
                         "config and the presets' Llama 3 tokenizer as metadata. Llama-family presets only; "
                         "Llama 3's RoPE scaling is left out. Run it with --model OUT/model.gguf")
    mm.set_defaults(func=_cmd_make_model)

    cg = sub.add_parser("convert-gguf", help="convert a GGUF file (llama, qwen2, qwen3, gemma3) into a Hugging Face directory")
    cg.add_argument("gguf", metavar="FILE.gguf")
    cg.add_argument("out", metavar="OUT_DIR")
    cg.set_defaults(func=_cmd_convert_gguf)

    gen = sub.add_parser("generate", help="generate text offline (continuous batching)")
    gen.add_argument("--model", default=None, help=default_help)
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (or use --file)")
    gen.add_argument("--file", help="a text file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--system", default=None, help="system message (implies --chat)")
    gen.add_argument("--chat-template", default=None, metavar="FILE",
                     help="Jinja chat template to use instead of the model's own (implies --chat)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="drop tokens below min_p x the top probability (0 = off)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], over the output")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], over the output")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 0, over prompt + output (1 = off)")
    gen.add_argument("--min-tokens", type=int, default=0, help="no EOS / stop before this many tokens")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed of every request")
    gen.add_argument("--stop", action="append", default=None, metavar="STR",
                     help="a stop string (not printed); repeat the flag for several")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stream", action="store_true",
                     help="print tokens as they come (always on for a single prompt)")
    add_engine_options(gen)
    gen.add_argument("--scheduling", choices=["continuous", "static"], default=None)
    gen.add_argument("--trace", action="store_true",
                     help="print every kernel launch and cuBLAS call of the first steps to stderr")
    gen.add_argument("--trace-steps", type=int, default=None, metavar="N",
                     help="steps to trace (implies --trace; default 2: the prefill and one decode)")
    gen.set_defaults(func=_cmd_generate)

    ins = sub.add_parser("inspect", help="config, tensors, weight / KV / arena memory of a model (no GPU)")
    ins.add_argument("--model", required=True, help="Hugging Face model directory or GGUF file")
    ins.add_argument("--quantization", choices=["fp8"], default=None, help="as the engine option")
    ins.add_argument("--max-model-len", type=int, default=None, help="context limit to size the KV cache for")
    ins.add_argument("--max-num-seqs", type=int, default=None, help="sequences per batch (arena plan)")
    ins.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (arena plan)")
    ins.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    ins.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N", help="each rank's share of N")
    ins.set_defaults(func=_cmd_inspect)

    bench = sub.add_parser("bench", help="latency / batch64 / throughput / prefix benchmark (table + JSON)")
    which = bench.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="model directory (default: --preset's)")
    which.add_argument("--preset", choices=PRESET_NAMES, default="llama-3.2-1b",
                       help="random-weight model, written once under --model-cache; "
                            f"{DEFAULT_MODEL}: the real default model")
    bench.add_argument("--model-cache", default="/tmp/tinyvllm-models", help="where presets go")
    bench.add_argument("--workload", choices=["latency", "throughput", "batch64", "prefix", "all"], default="all")
    bench.add_argument("--json", default=None, metavar="OUT.json", help="write every number here")
    add_comparison_arguments(bench)               # --compare-hf, --compare-vllm and their limits
    bench.add_argument("--num-requests", type=int, default=None,
                       help="override the request count of batch64 and throughput (small runs)")
    bench.add_argument("--min-len", type=int, default=None, help="override: shortest ragged length")
    bench.add_argument("--max-len", type=int, default=None, help="override: cap on every length")
    bench.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    add_engine_options(bench)
    bench.set_defaults(func=_cmd_bench)

    from tinyvllm.server.serve_cli import add_serve_command
    add_serve_command(sub, add_engine_options, engine_options_from_args)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:        # --help, or an argument error already printed in one line
        return e.code if isinstance(e.code, int) else 2
    from tinyvllm.logs import stderr_logging
    try:
        with stderr_logging():     # INFO on stderr: stdout keeps only what a command prints
            return args.func(args)
    except TinyVLLMError as e:
        print(f"tinyvllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
