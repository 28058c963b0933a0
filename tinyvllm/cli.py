"""`python -m tinyvllm <command>`: make-model, generate, bench, serve.

Each command lives in its own function; user errors (TinyVLLMError) become one line on stderr
and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import sys

from .errors import TinyVLLMError


def _cmd_make_model(args) -> int:
    from .model_writer import write_model
    path = write_model(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .model_writer import PRESETS
    p = argparse.ArgumentParser(prog="tinyvllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a random-weight Llama model in HF layout")
    mm.add_argument("out", help="output directory")
    mm.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    mm.add_argument("--seed", type=int, default=0)
    mm.set_defaults(func=_cmd_make_model)
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
