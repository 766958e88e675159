# Convenience wrappers; the README commands need nothing but Python.
default: demo

# set up and run the main job (a short what-if comparison on a bundled trace)
demo *ARGS:
    bash scripts/demo.sh {{ARGS}}

# set up and run the whole test suite
test *ARGS:
    bash scripts/test.sh {{ARGS}}

lint:
    .venv/bin/ruff check .

# property tests with fresh random examples (profile `fuzz`, tests/conftest.py) to find new
# counterexamples; `just test` and CI replay the same derandomized ones every run
fuzz *ARGS:
    HYPOTHESIS_PROFILE=fuzz .venv/bin/python -m pytest -p no:cacheprovider tests/property --hypothesis-show-statistics {{ARGS}}

nats:
    .venv/bin/evolving nats
