"""One place to configure structlog: console (human) or JSON lines (machines)."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Writes each line to whatever ``sys.stderr`` is *now*: a stream captured at configure time
    may be closed later (pytest swaps the standard streams per test; a daemonised child closes
    them), and a log line must never raise."""

    def msg(self, message: str) -> None:
        try:
            print(message, file=sys.stderr, flush=True)
        except (ValueError, OSError):  # the stream is closed: drop the line, not the caller
            pass

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _current_stderr_factory(*_args) -> _CurrentStderr:
    return _CurrentStderr()


def configure_logging(level: str | None = None, fmt: str | None = None, stream=None) -> None:
    """Configure structlog once. ``fmt`` is ``console`` or ``json`` (env ``EI_LOG_FORMAT``);
    ``level`` defaults to env ``EI_LOG_LEVEL`` or ``info``. Logs go to stderr."""
    global _configured
    level = (level or os.environ.get("EI_LOG_LEVEL", "info")).upper()
    fmt = fmt or os.environ.get("EI_LOG_FORMAT", "console")
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
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
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream) if stream else _current_stderr_factory,
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str = "evolving", **bind):
    """A lazy logger: it renders with the configuration current at each call, so a module-level
    logger made before the process's ``configure_logging(fmt="json")`` writes JSON too (binding it
    at import time froze the console renderer into every worker logger)."""
    if not _configured:
        configure_logging()
    return structlog.get_logger(name, **bind)
