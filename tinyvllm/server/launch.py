"""Build the engine and the app, then run uvicorn until Ctrl-C or SIGTERM.

Shutdown, the same on the first Ctrl-C and on SIGTERM (what `docker stop`, systemd and
Kubernetes send): uvicorn stops accepting connections; running requests get
`graceful_shutdown_s` to finish; then the engine loop stops and aborts the rest, so their
streams end with an error event and [DONE] (and waiting non-streamed requests get a 503)
rather than being cut mid-chunk; "server stopped" is logged and the exit status is 0. A second
Ctrl-C quits at once."""
from __future__ import annotations

import ipaddress
import logging
import signal
import threading
from dataclasses import dataclass, field

from tinyvllm.errors import TinyVLLMError

log = logging.getLogger("tinyvllm.server")

# --dtype values and the backend that computes in that type
DTYPES = {"cuda": ("auto", "bfloat16"), "cpu": ("auto", "float32")}


@dataclass(frozen=True)
class ServeOptions:
    model: str | None = None                   # None: the default model
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()   # default: the model argument, as vLLM does
    engine_options: dict = field(default_factory=dict)   # EngineConfig fields
    log_level: str = "info"                    # tinyvllm's own loggers
    uvicorn_log_level: str = "info"
    graceful_shutdown_s: float = 5.0
    allowed_origins: tuple[str, ...] = ()      # CORS, off unless given
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    chat_template: str | None = None           # a file, or the template itself (the tokenizer's)
    dtype: str = "auto"
    log_requests: bool = True
    log_stats: bool = True                     # /metrics and the periodic stats line
    max_body_bytes: int = 16 * 2**20           # larger request bodies get a 413, unread
    enable_docs: bool = False                  # FastAPI's /docs, /redoc, /openapi.json

    @property
    def model_names(self) -> tuple[str, ...]:
        from tinyvllm.checkpoint.default_model import DEFAULT_MODEL
        return self.served_model_names or (self.model or DEFAULT_MODEL,)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require_server_dependencies() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise TinyVLLMError(f"the server needs FastAPI, uvicorn and prometheus_client ({e}); "
                            "install them with: pip install 'tinyvllm[server]'") from None


def check_dtype(dtype: str, device: str) -> None:
    """tinyvllm computes in one type per backend: bf16 weights and activations on the GPU, the
    float32 reference on the CPU. --dtype may only name it."""
    if device in DTYPES and dtype not in DTYPES[device]:
        raise TinyVLLMError(f"--dtype {dtype} is not supported on --device {device}; use "
                            f"{' or '.join(DTYPES[device])} (tinyvllm computes in "
                            f"{DTYPES[device][1]} there)")


def build_server(options: ServeOptions):
    """(app, engine_loop) for `options`; the engine is built (and the model loaded) here."""
    _require_server_dependencies()
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.server.app import ServerSettings, build_app
    from tinyvllm.server.engine_loop import EngineLoop

    check_dtype(options.dtype, options.engine_options.get("device", "cuda"))
    engine = LLMEngine(options.model, chat_template=options.chat_template, **options.engine_options)
    settings = ServerSettings(
        model_names=options.model_names, api_key=options.api_key, model_path=options.model,
        allowed_origins=options.allowed_origins, allowed_methods=options.allowed_methods,
        allowed_headers=options.allowed_headers, allow_credentials=options.allow_credentials,
        log_requests=options.log_requests,
        log_stats=options.log_stats, max_body_bytes=options.max_body_bytes,
        enable_docs=options.enable_docs)
    engine_loop = EngineLoop(engine)
    return build_app(engine_loop, settings), engine_loop


class _Terminated(Exception):
    """SIGTERM, once uvicorn has shut down gracefully: what KeyboardInterrupt is to Ctrl-C."""


def _raise_terminated(signum, frame):
    raise _Terminated


def run_server(options: ServeOptions) -> int:
    _require_server_dependencies()
    from tinyvllm.logs import stderr_logging
    with stderr_logging(options.log_level):
        return _serve_until_stopped(options)


def _serve_until_stopped(options: ServeOptions) -> int:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On the first exit signal, stop the engine loop after the grace period."""

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log.info("shutting down (%s): %.0fs for running requests to finish",
                         signal.Signals(sig).name, options.graceful_shutdown_s)
                timer = threading.Timer(options.graceful_shutdown_s, engine_loop.stop)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    if not is_loopback(options.host) and not options.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use "
                    "the model", options.host)
    # uvicorn handles SIGTERM like Ctrl-C, then re-raises it under the handler it found at start:
    # with the default one the process would die of the signal instead of exiting 0. (Ours also
    # covers the model load: SIGTERM then stops the start-up, with status 0 too.)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    engine_loop = None
    try:
        app, engine_loop = build_server(options)
        log.info("serving %s on http://%s:%d/v1", ", ".join(repr(n) for n in options.model_names),
                 options.host, options.port)
        # uvicorn's own timeout is only a backstop: by then our streams have ended themselves.
        config = uvicorn.Config(app, host=options.host, port=options.port,
                                log_level=options.uvicorn_log_level,
                                timeout_graceful_shutdown=options.graceful_shutdown_s + 5)
        server = DrainingServer(config)
        # a dead engine (EngineLoop.dead) stops the server; it then exits 1, below
        engine_loop.on_dead = lambda why: setattr(server, "should_exit", True)
        try:
            server.run()
        except KeyboardInterrupt:   # re-raised by uvicorn once it has shut down
            pass
    except _Terminated:
        pass
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if engine_loop is not None and engine_loop.dead:
        log.error("server stopped: the engine died (%s); exit status 1", engine_loop.dead)
        return 1
    log.info("server stopped")
    return 0
