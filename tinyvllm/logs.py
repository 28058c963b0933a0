"""The `tinyvllm` logger. The command line runs inside stderr_logging(): one stderr handler,
level INFO unless $TINYVLLM_LOGGING_LEVEL (or the caller) says otherwise, and the logger's
previous state back afterwards. Used as a library, tinyvllm adds no handler: its INFO lines
appear only if the application configures logging."""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from tinyvllm.errors import TinyVLLMError

LEVELS = ("critical", "error", "warning", "info", "debug")


class _Handler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test may swap it), and is a type of its
    own, so that nested stderr_logging() blocks never add a second one."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


@contextlib.contextmanager
def stderr_logging(level: str | None = None):
    level = (level or os.environ.get("TINYVLLM_LOGGING_LEVEL") or "info").lower()
    if level not in LEVELS:
        raise TinyVLLMError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    logger = logging.getLogger("tinyvllm")
    saved = logger.level, logger.propagate, list(logger.handlers)
    if not any(isinstance(h, _Handler) for h in logger.handlers):
        handler = _Handler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s",
                                               "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False          # one line per record, whatever the root logger does
    try:
        yield logger
    finally:
        logger.level, logger.propagate, logger.handlers[:] = saved[0], saved[1], saved[2]
