"""What a pytest run from the repository root collects: the tests or the benchmarks.

``testpaths`` (pyproject.toml) names both ``tests`` and ``bench``; which of the two a run
collects depends on ``--benchmark-only`` (pytest-benchmark's option):

* ``pytest``                   the tests (tests/); bench/ is not collected, so the
                               benchmarks never run as tests
* ``pytest --benchmark-only``  the benchmarks (bench/); tests/ is not collected (pytest-benchmark
                               would only import and skip every test in it)

The same holds for a run that reaches the two folders by recursion (``pytest .``). A folder
or file named on the command line is always collected (``pytest bench/bench_codec.py``), as
pytest does for every path it is given. A ``--benchmark-only`` run that collects no benchmark
at all is a usage error (exit 4), never a green run that measured nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
TESTS = ROOT / "tests"
BENCH = ROOT / "bench"


def _benchmark_only(config: pytest.Config) -> bool:
    return bool(config.getoption("benchmark_only", default=False))


def _left_out(config: pytest.Config) -> Path:
    """The folder this run does not collect unless named."""
    return TESTS if _benchmark_only(config) else BENCH


def pytest_configure(config: pytest.Config) -> None:
    # The paths from `testpaths` are initial paths, which pytest never passes to
    # pytest_ignore_collect: drop the one this run leaves out from them here.
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS:
        left_out = _left_out(config)
        base = config.invocation_params.dir
        config.args[:] = [a for a in config.args if (base / a.split("::", 1)[0]).resolve() != left_out]


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Reached by recursion from a folder above (`pytest .`); a named path never gets here.
    if collection_path.resolve() == _left_out(config):
        return True
    return None  # no opinion: pytest's own rules apply


def pytest_collection_finish(session: pytest.Session) -> None:
    if not _benchmark_only(session.config):
        return
    if not any("benchmark" in getattr(item, "fixturenames", ()) for item in session.items):
        raise pytest.UsageError(
            f"--benchmark-only collected no benchmark ({len(session.items)} items, none using the "
            "benchmark fixture): nothing would be measured"
        )
