"""`python -m tinyvllm serve`: its arguments (vLLM's names) and how they become ServeOptions.
Imports nothing of the server itself until the command runs, so `--help` needs no server extra."""
from __future__ import annotations

import json
import os

from tinyvllm.errors import TinyVLLMError


def add_serve_command(subparsers, add_engine_options, engine_options_from_args) -> None:
    sv = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (needs tinyvllm[server])")
    sv.add_argument("model_tag", nargs="?", metavar="MODEL", help="Hugging Face model directory")
    sv.add_argument("--model", default=None, help="the same, as an option")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("TINYVLLM_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1 routes "
                         "(default: $TINYVLLM_API_KEY, which keeps the key out of `ps`)")
    sv.add_argument("--served-model-name", action="extend", nargs="+", default=None, metavar="NAME",
                    help="the model id(s) clients may send; the first is the default and the "
                         "one responses and metrics report (default: the model argument)")
    sv.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                    help="CORS: browser origins allowed to call the API, as a JSON list or "
                         "repeated; '*' allows any (default: none, no CORS headers)")
    sv.add_argument("--allowed-methods", action="append", default=None, metavar="METHOD",
                    help="CORS methods (JSON list or repeated; default: all)")
    sv.add_argument("--allowed-headers", action="append", default=None, metavar="HEADER",
                    help="CORS request headers (JSON list or repeated; default: all)")
    sv.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    sv.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                    help="a Jinja2 chat template (a file, or the template itself) instead of the "
                         "tokenizer's")
    sv.add_argument("--dtype", default="auto",
                    help="auto; the one type each backend computes in: bfloat16 (cuda), float32 (cpu)")
    sv.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                    help="sampling defaults: auto (the model's generation_config.json), vllm "
                         "(none), or a directory holding a generation_config.json")
    sv.add_argument("--log-level", default=os.environ.get("TINYVLLM_LOGGING_LEVEL", "info").lower(),
                    choices=["critical", "error", "warning", "info", "debug"],
                    help="tinyvllm's log (default: $TINYVLLM_LOGGING_LEVEL or info)")
    sv.add_argument("--uvicorn-log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug", "trace"],
                    help="uvicorn's log, with its access lines (default: info)")
    sv.add_argument("--disable-log-requests", action="store_true",
                    help="do not log each request (its prompt and sampling parameters)")
    sv.add_argument("--disable-log-stats", action="store_true",
                    help="collect no engine statistics: no /metrics, no periodic stats line")
    sv.add_argument("--max-body-bytes", type=_positive_int, default=16 * 2**20, metavar="N",
                    help="largest request body accepted; larger ones get a 413 before they are "
                         "read (default: 16 MiB)")
    sv.add_argument("--enable-docs", action="store_true",
                    help="serve FastAPI's /docs, /redoc and /openapi.json (default: off)")
    add_engine_options(sv)
    sv.set_defaults(func=lambda args: cmd_serve(args, engine_options_from_args))


def cmd_serve(args, engine_options_from_args) -> int:
    from tinyvllm.server.launch import ServeOptions, run_server
    if args.model and args.model_tag and args.model != args.model_tag:
        raise TinyVLLMError(f"two models given ({args.model_tag} and --model {args.model}); "
                            "give one")
    model = args.model_tag or args.model
    if not model:
        raise TinyVLLMError("no model given: python -m tinyvllm serve MODEL_DIR")
    options = engine_options_from_args(args)
    if args.generation_config is not None:
        options["generation_config"] = args.generation_config
    return run_server(ServeOptions(
        model=model, host=args.host, port=args.port, api_key=args.api_key,
        served_model_names=tuple(args.served_model_name or ()), engine_options=options,
        log_level=args.log_level, uvicorn_log_level=args.uvicorn_log_level,
        allowed_origins=_json_or_values("--allowed-origins", args.allowed_origins, ()),
        allowed_methods=_json_or_values("--allowed-methods", args.allowed_methods, ("*",)),
        allowed_headers=_json_or_values("--allowed-headers", args.allowed_headers, ("*",)),
        allow_credentials=args.allow_credentials, chat_template=args.chat_template,
        dtype=args.dtype, log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats, max_body_bytes=args.max_body_bytes,
        enable_docs=args.enable_docs))


def _positive_int(text: str) -> int:
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _json_or_values(flag: str, values: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """A list flag given as a JSON list (vLLM's form: --allowed-origins '["https://a"]'), or
    repeated (--allowed-origins https://a --allowed-origins https://b), or both."""
    if not values:
        return default
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError as e:
                raise TinyVLLMError(f"{flag}: invalid JSON list {value!r} ({e})") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise TinyVLLMError(f"{flag}: expected a JSON list of strings, got {value!r}")
            out += items
        else:
            out.append(value)
    return tuple(out)
