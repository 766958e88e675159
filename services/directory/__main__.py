"""``python -m services.directory``: the live directory service (see services/live/serve.py, docs/live.md)."""

import sys

from services.live.serve import main

if __name__ == "__main__":
    sys.exit(main("directory"))
