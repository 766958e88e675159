"""``python -m services.recorder``: the live recorder service (services/live/serve.py, docs/live.md).

The driver is imported only when this file runs as a program: importing the recorder's
adapters (event log, views, verify) never pulls in the live services.
"""

import importlib
import sys

if __name__ == "__main__":
    sys.exit(importlib.import_module("services.live.serve").main("recorder"))
