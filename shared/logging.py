"""structlog setup: configured once per process, JSON unless stderr is a TTY.

Bind a request id with `structlog.contextvars.bound_contextvars(request_id=...)`;
every log line inside carries it.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info", fmt: str = "auto") -> None:
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        lvl = logging.INFO
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.dev.ConsoleRenderer()
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries that use stdlib logging (nats, uvicorn) go to stderr at WARNING.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def get_logger(name: str | None = None):
    return structlog.get_logger(name)
