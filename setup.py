"""Declares the Cython extensions; everything else about the distribution is in pyproject.toml.

Every ``ext/_<name>.pyx`` present is built as ``ext._<name>`` (a hot path that is not written
yet simply is not built). Compiler directives are set here, once, for all of them.

``ASYNCRL_DEBUG_CYTHON=1`` builds with bounds, wraparound and initialization checks on, at
``-O0 -g`` with C asserts enabled. Switching between the two modes regenerates the C sources (the mode of the last
build is remembered in ``build/cython-mode``), so the directives always match the mode.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
DEBUG = os.environ.get("ASYNCRL_DEBUG_CYTHON", "").strip() == "1"
MODE = "debug" if DEBUG else "release"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "cdivision": True,
    "initializedcheck": DEBUG,
    "nonecheck": False,
}
# -UNDEBUG turns on the C asserts (CPython's own header checks among them) in debug builds.
EXTRA_COMPILE_ARGS = ["-O0", "-g", "-UNDEBUG"] if DEBUG else []


def _extensions() -> list[Extension]:
    """One extension per ext/_*.pyx, named ext._<name>, paths relative to this file."""
    return [
        Extension(
            f"ext.{pyx.stem}",
            [pyx.relative_to(HERE).as_posix()],
            include_dirs=[numpy.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            extra_compile_args=EXTRA_COMPILE_ARGS,
        )
        for pyx in sorted((HERE / "ext").glob("_*.pyx"))
    ]


def _mode_changed() -> bool:
    """True when the last build was made in the other mode (or is unknown); records this one."""
    marker = HERE / "build" / "cython-mode"
    try:
        changed = marker.read_text() != MODE
    except OSError:
        changed = True
    if changed:
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(MODE)
    return changed


os.chdir(HERE)  # cythonize and setuptools want source paths relative to the project root
setup(
    ext_modules=cythonize(
        _extensions(),
        compiler_directives=DIRECTIVES,
        force=_mode_changed(),
    ),
)
