"""The structured logs: a module-level logger follows the format the process configures later."""

from __future__ import annotations

import io
import json

from services.adapters import logging as ei_logging


def test_a_logger_made_before_configure_writes_the_format_configured_later():
    log = ei_logging.get_logger("worker", node="n0")  # as a module does at import time
    out = io.StringIO()
    try:
        ei_logging.configure_logging(level="info", fmt="json", stream=out)
        log.info("worker_ready", role="prefill")
        ei_logging.configure_logging(level="info", fmt="console", stream=out)
        log.info("worker_stopped")
    finally:
        ei_logging.configure_logging()
    first, second = out.getvalue().splitlines()
    rec = json.loads(first)
    assert rec["event"] == "worker_ready" and rec["node"] == "n0" and rec["role"] == "prefill"
    assert rec["level"] == "info"
    assert "worker_stopped" in second and not second.startswith("{")  # console again


def test_the_level_configured_later_filters_an_early_logger():
    log = ei_logging.get_logger("worker")
    out = io.StringIO()
    try:
        ei_logging.configure_logging(level="warning", fmt="json", stream=out)
        log.info("hidden")
        log.warning("shown")
    finally:
        ei_logging.configure_logging()
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["shown"]
