"""atheris fuzz targets for the readers of untrusted bytes (``make fuzz``; see fuzz/run.py)."""
