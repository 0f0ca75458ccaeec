"""Shared pytest configuration for the test suite."""

import os

from hypothesis import settings

# Shared machines (CI on 2 cores) make per-example timings noisy: no deadlines, and always
# print the blob that reproduces a failure.
settings.register_profile("asyncrl", deadline=None, print_blob=True)
# CI (CI=true) explores the same examples on every run, so a red build is reproducible and
# never a coin flip; local runs keep exploring new ones.
settings.register_profile("ci", parent=settings.get_profile("asyncrl"), derandomize=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "asyncrl")
