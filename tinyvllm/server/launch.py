"""Build the engine and the app, then run uvicorn until Ctrl-C.

Shutdown order on Ctrl-C (uvicorn's): stop accepting connections, give open responses up to
`graceful_shutdown_s` to finish, then the app's lifespan stops the engine loop, which aborts
whatever is still running."""
from __future__ import annotations

import ipaddress
import logging
import sys
from dataclasses import dataclass, field

from ..errors import TinyVLLMError

log = logging.getLogger("tinyvllm.server")


@dataclass(frozen=True)
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None       # default: the --model argument, as vLLM does
    engine_options: dict = field(default_factory=dict)   # EngineConfig fields
    log_level: str = "info"
    graceful_shutdown_s: float = 5.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_server(options: ServeOptions):
    """(app, engine_loop) for `options`; the engine is built (and the model loaded) here."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise TinyVLLMError(f"the server needs FastAPI and uvicorn ({e}); "
                            "install them with: pip install 'tinyvllm[server]'") from None
    from ..engine import LLMEngine
    from .app import ServerSettings, build_app
    from .engine_loop import EngineLoop

    engine = LLMEngine(options.model, **options.engine_options)
    settings = ServerSettings(model_name=options.served_model_name or options.model,
                              api_key=options.api_key)
    engine_loop = EngineLoop(engine)
    return build_app(engine_loop, settings), engine_loop


def run_server(options: ServeOptions) -> int:
    import uvicorn
    logging.basicConfig(level=options.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(options.host) and not options.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use "
                    "the model", options.host)
    app, _ = build_server(options)
    name = options.served_model_name or options.model
    log.info("serving %r on http://%s:%d/v1", name, options.host, options.port)
    uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level,
                timeout_graceful_shutdown=options.graceful_shutdown_s)
    return 0
