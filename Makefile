# asyncrl: set up, build the Cython hot paths, run, test.
#
#   make test     the whole suite on the compiled extensions, again on the pure-Python
#                 references (ASYNCRL_PUREPYTHON=1), then the micro-benchmarks
#   make run      the quickstart scenario
#   make bench    the micro-benchmarks alone, then the hot paths' targets as measured ratios
#   make build    rebuild the extensions in place (ASYNCRL_DEBUG_CYTHON=1 for a debug build)
#   make clean    remove build outputs (keeps .venv)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Reinstalled (and the extensions rebuilt) only when what the install depends on changes.
STAMP := $(VENV)/.asyncrl-installed
EXT_SOURCES := $(wildcard ext/*.pyx ext/*.pxd)

.PHONY: setup venv build run test bench clean

setup venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel

# `pip install -e` builds the extensions in place (ext/_*.so), importable from the repo root.
$(STAMP): pyproject.toml setup.py $(EXT_SOURCES) | $(PY)
	$(PY) -m pip install -e ".[dev,cpu]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

build: $(STAMP)
	$(PY) setup.py build_ext --inplace

run: $(STAMP)
	$(PY) -m harness.run scenarios/quickstart.yaml

test: $(STAMP)
	ASYNCRL_PUREPYTHON=0 $(PY) -m pytest tests
	ASYNCRL_PUREPYTHON=1 $(PY) -m pytest tests
	$(MAKE) --no-print-directory bench

bench: $(STAMP)
	mkdir -p .benchmarks
	$(PY) -m pytest bench --benchmark-only --benchmark-json=.benchmarks/last.json
	$(PY) bench/targets.py .benchmarks/last.json

clean:
	rm -rf build *.egg-info .pytest_cache .benchmarks .hypothesis
	rm -f ext/*.so $(patsubst %.pyx,%.c,$(wildcard ext/*.pyx)) $(STAMP)
