"""A torch learner's state as numpy arrays: its networks' weights and Adam's moments, what a
sampler is sent and what a checkpoint (``core/store/checkpoint.py``) holds."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def weights_of(net: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in net.state_dict().items()}


def load_into(net: nn.Module, weights: dict[str, np.ndarray]) -> None:
    # A copy: weights fetched from the object store are read-only views.
    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})


def adam_arrays(opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """The optimizer's per-parameter state ("<param index>.<name>"); hyperparameters are the
    scenario's and are not kept."""
    out = {}
    for i, per_param in opt.state_dict()["state"].items():
        for k, v in per_param.items():
            out[f"{i}.{k}"] = np.atleast_1d(v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v))
    return out


def load_adam(opt: torch.optim.Optimizer, arrays: dict[str, np.ndarray]) -> None:
    sd = opt.state_dict()
    state: dict[int, dict] = {}
    for key, v in arrays.items():
        i, k = key.split(".", 1)
        t = torch.from_numpy(np.array(v))
        state.setdefault(int(i), {})[k] = t.reshape(()) if k == "step" else t
    sd["state"] = state
    opt.load_state_dict(sd)


def generator_state(gen: torch.Generator) -> dict[str, np.ndarray]:
    return {"state": gen.get_state().numpy().copy()}


def load_generator(gen: torch.Generator, arrays: dict[str, np.ndarray]) -> None:
    gen.set_state(torch.from_numpy(np.array(arrays["state"], dtype=np.uint8)))
