"""Build the engine and the app, then run uvicorn until Ctrl-C.

Shutdown on the first Ctrl-C: uvicorn stops accepting connections; running requests get
`graceful_shutdown_s` to finish; then the engine loop stops and aborts the rest, so their
streams end with an error event and [DONE] (and waiting non-streamed requests get a 503)
rather than being cut mid-chunk. A second Ctrl-C quits at once."""
from __future__ import annotations

import ipaddress
import logging
import sys
import threading
from dataclasses import dataclass, field

from tinyvllm.errors import TinyVLLMError

log = logging.getLogger("tinyvllm.server")


@dataclass(frozen=True)
class ServeOptions:
    model: str | None = None                   # None: the default model
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None       # default: the --model argument, as vLLM does
    engine_options: dict = field(default_factory=dict)   # EngineConfig fields
    log_level: str = "info"
    graceful_shutdown_s: float = 5.0
    chat_template: str | None = None           # a template file instead of the model's own


def served_name(options: ServeOptions) -> str:
    from tinyvllm.checkpoint.default_model import DEFAULT_MODEL
    return options.served_model_name or options.model or DEFAULT_MODEL


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
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise TinyVLLMError(f"the server needs FastAPI and uvicorn ({e}); "
                            "install them with: pip install 'tinyvllm[server]'") from None


def build_server(options: ServeOptions):
    """(app, engine_loop) for `options`; the engine is built (and the model loaded) here."""
    _require_server_dependencies()
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.server.app import ServerSettings, build_app
    from tinyvllm.server.engine_loop import EngineLoop

    engine = LLMEngine(options.model, chat_template=options.chat_template, **options.engine_options)
    settings = ServerSettings(model_name=served_name(options),
                              api_key=options.api_key)
    engine_loop = EngineLoop(engine)
    return build_app(engine_loop, settings), engine_loop


def run_server(options: ServeOptions) -> int:
    _require_server_dependencies()
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On the first exit signal, stop the engine loop after the grace period."""

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log.info("shutting down: %.0fs for running requests to finish",
                         options.graceful_shutdown_s)
                timer = threading.Timer(options.graceful_shutdown_s, engine_loop.stop)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    logging.basicConfig(level=options.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(options.host) and not options.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use "
                    "the model", options.host)
    app, engine_loop = build_server(options)
    log.info("serving %r on http://%s:%d/v1", served_name(options),
             options.host, options.port)
    # uvicorn's own timeout is only a backstop: by then our streams have ended themselves.
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                            timeout_graceful_shutdown=options.graceful_shutdown_s + 5)
    try:
        DrainingServer(config).run()
    except KeyboardInterrupt:   # uvicorn re-raises the Ctrl-C it handled, once it has shut down
        pass
    log.info("server stopped")
    return 0
