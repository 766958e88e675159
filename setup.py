"""Compiled inner loops (the measurements behind each are in docs/directory.md and
docs/simulator.md §8). Everything else is in pyproject.toml. ``pip install -e .`` (scripts/setup.sh)
builds them in place; gcc and Cython (a build requirement) are all they need."""

from Cython.Build import cythonize
from setuptools import Extension, setup

_DIRECTIVES = {"language_level": 3, "boundscheck": False, "wraparound": False}

setup(ext_modules=cythonize(
    [Extension("services.cores.directory._native", ["services/cores/directory/_native.pyx"]),
     Extension("engine._kvscan", ["engine/_kvscan.pyx"]),
     Extension("replay.traces._chain", ["replay/traces/_chain.pyx"])],
    compiler_directives=_DIRECTIVES, quiet=True))
