"""The core's one compiled part, optional: kvwire._copy (src/kvwire/_copy.c), a copy with
non-temporal stores that kvwire.copying loads with ctypes. Where no C compiler is found the
build goes on without it and kvwire copies with memmove (``kvwire doctor`` says which)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvwire._copy", ["src/kvwire/_copy.c"], optional=True)])
