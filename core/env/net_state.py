"""A torch learner's state as numpy arrays: its networks' weights and Adam's moments, what a
sampler is sent and what a checkpoint (``core/store/checkpoint.py``) holds; and the learners'
gradients kept in one flat buffer, which the global-norm clip reads and scales in one op each."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.optim.adam import adam


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


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """One zeroed buffer holding every parameter's gradient, each ``.grad`` a view of it.

    Zero it (``.zero_()``) before each backward, never set the grads to None: autograd then adds
    into the views in place, so the buffer stays theirs, and the clip below is one norm and one
    scale instead of a pass per parameter. A parameter backward does not reach keeps a zero grad
    (Adam still steps it, where a None grad would be skipped): the learners train every parameter."""
    buf = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    at = 0
    for p in params:
        p.grad = buf[at:at + p.numel()].view_as(p)
        at += p.numel()
    return buf


def clip_flat_(grads: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s clip (scale by max_norm / (norm + 1e-6) where that is
    below 1) on the buffer of ``flat_grads``; returns the norm before clipping."""
    norm = torch.linalg.vector_norm(grads)
    grads.mul_((max_norm / (norm + 1e-6)).clamp_(max=1.0))
    return norm


def adam_step(opt: torch.optim.Adam) -> None:
    """``opt.step()`` for the learners' fused Adam (one parameter group, no amsgrad), through torch's
    functional ``adam``: the same kernel on the same state, without ``Optimizer.step``'s Python
    around it (hooks, profiling scope, per-parameter state checks), which took longer than the
    kernel. The first step goes through ``opt.step()``, which makes the state."""
    (group,) = opt.param_groups
    params = group["params"]
    state = [opt.state[p] for p in params]
    if not state[0] or group["amsgrad"]:
        opt.step()
        return
    beta1, beta2 = group["betas"]
    adam(
        params, [p.grad for p in params], [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state], [],
        [s["step"] for s in state], fused=group["fused"], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        decoupled_weight_decay=group.get("decoupled_weight_decay", False),
    )
