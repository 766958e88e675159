"""``python -m services.planner``: the live planner service (services/live/serve.py, docs/live.md).

This package is a pure core; the driver is imported only when this file runs as a program, so
importing ``services.planner`` never pulls in NATS, aiohttp or the live services.
"""

import importlib
import sys

if __name__ == "__main__":
    sys.exit(importlib.import_module("services.live.serve").main("planner"))
