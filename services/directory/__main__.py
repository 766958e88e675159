"""``python -m services.directory``: the live directory service (services/live/serve.py, docs/live.md).

This package is a pure core; the driver is imported only when this file runs as a program, so
importing ``services.directory`` never pulls in NATS, aiohttp or the live services.
"""

import importlib
import sys

if __name__ == "__main__":
    sys.exit(importlib.import_module("services.live.serve").main("directory"))
