"""Shared pytest configuration for the test suite."""

from hypothesis import settings

# Shared machines (CI on 2 cores) make per-example timings noisy: no deadlines, and always
# print the blob that reproduces a failure.
settings.register_profile("asyncrl", deadline=None, print_blob=True)
settings.load_profile("asyncrl")
