"""How many Hypothesis examples a property test runs.

A test that pins its count (``max_examples=examples(N)``) runs ``N`` under the ``ci`` profile (the
default: CI, ``scripts/test.sh``) and at least the ``fuzz`` profile's count under
``HYPOTHESIS_PROFILE=fuzz``: a count written in a ``@settings`` decorator overrides the loaded
profile, so without this a pinned test would run its CI count in a fuzz run too."""

from __future__ import annotations

import os

FUZZ_EXAMPLES = 1000
FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"


def examples(ci: int) -> int:
    return max(ci, FUZZ_EXAMPLES) if FUZZ else ci
