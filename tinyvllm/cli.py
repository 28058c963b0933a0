"""`python -m tinyvllm <command>`: make-model, generate, bench, serve.

Each command lives in its own function; user errors (TinyVLLMError) become one line on stderr
and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import os
import sys

from .errors import TinyVLLMError


def _cmd_make_model(args) -> int:
    from .model_writer import write_model
    path = write_model(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} model to {path}")
    return 0


# EngineConfig fields settable from the command line; unset flags keep EngineConfig's defaults.
def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (default) or cpu (the numpy reference backend)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences per decode batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens per prefill step")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's max_position_embeddings)")
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache size (default: a fraction of free GPU memory)")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")


def engine_options_from_args(args) -> dict:
    names = ("device", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_gb",
             "enforce_eager")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _cmd_serve(args) -> int:
    from .server.launch import ServeOptions, run_server
    return run_server(ServeOptions(
        model=args.model, host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, engine_options=engine_options_from_args(args),
        log_level=args.log_level))


def build_parser() -> argparse.ArgumentParser:
    from .model_writer import PRESETS
    p = argparse.ArgumentParser(prog="tinyvllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a random-weight Llama model in HF layout")
    mm.add_argument("out", help="output directory")
    mm.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    mm.add_argument("--seed", type=int, default=0)
    mm.set_defaults(func=_cmd_make_model)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs tinyvllm[server])")
    sv.add_argument("--model", required=True, help="Hugging Face model directory")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("TINYVLLM_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1 routes "
                         "(default: $TINYVLLM_API_KEY, which keeps the key out of `ps`)")
    sv.add_argument("--served-model-name", default=None,
                    help="the model id clients send (default: the --model argument)")
    sv.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(sv)
    sv.set_defaults(func=_cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TinyVLLMError as e:
        print(f"tinyvllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
