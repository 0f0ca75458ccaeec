"""The ASYNCRL_PUREPYTHON switch (ext/backend.py), for every hot path."""

import importlib
import logging
import os
import sys

import pytest

from ext import backend

HOT_PATHS = ["squeue", "replay", "codec"]
PURE = os.environ.get(backend.ENV_VAR, "").strip() == "1"


@pytest.mark.parametrize("name", HOT_PATHS)
def test_each_selector_serves_the_backend_asked_for(name):
    selector = importlib.import_module(f"ext.{name}")
    mode = backend.requested()
    if mode == "pure":
        assert selector.BACKEND == "ref"
    elif mode == "compiled":
        assert selector.BACKEND == "ext"


@pytest.mark.parametrize("name", HOT_PATHS)
def test_pure_python_selects_the_reference(monkeypatch, name):
    monkeypatch.setenv(backend.ENV_VAR, "1")
    module = backend.load(name)
    assert module is importlib.import_module(f"ext._{name}_ref")
    assert backend.name_of(module) == "ref"


@pytest.mark.skipif(PURE, reason="ASYNCRL_PUREPYTHON=1: the compiled modules are deliberately not used")
@pytest.mark.parametrize("name", HOT_PATHS)
def test_compiled_selects_the_extension(monkeypatch, name):
    monkeypatch.setenv(backend.ENV_VAR, "0")
    module = backend.load(name)
    assert module is importlib.import_module(f"ext._{name}")  # an ImportError fails the test
    assert backend.name_of(module) == "ext"


@pytest.mark.parametrize("name", HOT_PATHS)
def test_compiled_but_unimportable_raises(monkeypatch, name):
    monkeypatch.setenv(backend.ENV_VAR, "0")
    monkeypatch.setitem(sys.modules, f"ext._{name}", None)  # makes the import fail
    with pytest.raises(RuntimeError, match=rf"ext\._{name}"):
        backend.load(name)


def test_compiled_but_missing_raises(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "0")
    with pytest.raises(RuntimeError, match=r"ext\._no_such_hot_path"):
        backend.load("no_such_hot_path")


def test_auto_falls_back_to_the_references_with_one_warning(monkeypatch, caplog):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    for name in HOT_PATHS:
        monkeypatch.setitem(sys.modules, f"ext._{name}", None)
    monkeypatch.setattr(backend, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        for name in HOT_PATHS:
            assert backend.load(name) is importlib.import_module(f"ext._{name}_ref")
    warnings = [r for r in caplog.records if r.name == backend.__name__]
    assert len(warnings) == 1 and "pure-Python" in warnings[0].getMessage()


@pytest.mark.parametrize("value", ["yes", "true", "2", "pure"])
def test_garbage_switch_value_raises(monkeypatch, value):
    monkeypatch.setenv(backend.ENV_VAR, value)
    with pytest.raises(RuntimeError, match=backend.ENV_VAR):
        backend.load("squeue")
