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

nats:
    .venv/bin/evolving nats
