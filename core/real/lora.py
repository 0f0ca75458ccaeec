"""LoRA (``trainer.lora``): the adapter the torch trainer trains through peft, the names its
tensors travel under, and how an engine applies them to its own base weights.

The trainer wraps its model with peft (``wrap``): every targeted linear layer W0 (out x in)
computes W0 x + (alpha / r) B A x, with A (r x in) and B (out x r) the only trainable
tensors. A weight sync moves those tensors alone, named after the layer they adapt:

    model.layers.0.self_attn.q_proj.lora_A.weight    (r, in)
    model.layers.0.self_attn.q_proj.lora_B.weight    (out, r)

(peft's own names carry its wrapper's prefix and the adapter's name; these do not, so an
engine needs no peft to read them). An engine applies them by merging (``AdapterMerge``):
W = W0 + (alpha / r) B A, computed in float32 from the base weights it loaded itself, then
cast to its dtype. Merged, a decode step costs what it cost without the adapter, and the
engine's forward (its KV-cache layers, its attention) stays the plain model's. An engine keeps
a copy of the targeted base weights for that, never adds onto weights already merged.

An adapter that did not arrive must never look like a slow policy: every sync is checked
against the names and shapes the engine expects (``expected_specs``); a missing, extra or
misshapen tensor is one error naming it (``AdapterMismatch``), and the engine keeps serving
nothing until a sync succeeds.

torch and peft are imported on use: the evaluators' driver imports this module and never
applies an adapter.
"""

from __future__ import annotations

from typing import Any, Iterator

from core.model.config import LoraSpec
from core.real.weight_broadcast import ManifestMismatch, TensorSpec

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # the one adapter peft names, as peft names it
HALVES = ("lora_A", "lora_B")


class AdapterMismatch(ManifestMismatch):
    """A sync's adapter tensors are not the ones this engine applies (missing, extra, or another shape)."""


def scale(spec: LoraSpec) -> float:
    """alpha / r: what B A is multiplied by (peft's ``scaling``, without rsLoRA)."""
    return spec.alpha / spec.rank


def wrap(model: Any, spec: LoraSpec) -> Any:
    """``model`` as a peft model training only a fresh adapter (base frozen, no dropout: the
    trainer's forward is the merged engine's, up to rounding)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0, bias="none")
    return get_peft_model(model, config)


def sync_name(peft_name: str) -> str:
    """peft's parameter name -> the name a sync carries it under (the module docstring)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    for half in HALVES:
        name = name.replace(f".{half}.{ADAPTER}.", f".{half}.")
    return name


def adapter_parameters(peft_model: Any) -> dict[str, Any]:
    """The live adapter tensors of a ``wrap``ped model under their sync names, in the model's order."""
    return {sync_name(n): p for n, p in peft_model.named_parameters() if p.requires_grad}


def targeted(model: Any, spec: LoraSpec) -> Iterator[tuple[str, Any]]:
    """(name, module) of every linear layer of a plain model that ``spec`` adapts, in order."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in spec.targets:
            yield name, module


def expected_specs(model: Any, spec: LoraSpec, dtype: str) -> list[TensorSpec]:
    """The adapter tensors a sync brings a plain model, in ``dtype``, in the trainer's order."""
    out = []
    for name, module in targeted(model, spec):
        out.append(TensorSpec(f"{name}.lora_A.weight", (spec.rank, module.in_features), dtype))
        out.append(TensorSpec(f"{name}.lora_B.weight", (module.out_features, spec.rank), dtype))
    return out


def adapter_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


class AdapterMerge:
    """An engine's side: the base weights of the targeted layers (a copy, as loaded), and the
    adapter tensors a sync lands in; ``merge`` sets every targeted weight to W0 + scale B A."""

    def __init__(self, model: Any, spec: LoraSpec, who: str) -> None:
        import torch

        self.who = who
        self.scale = scale(spec)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.specs = expected_specs(model, spec, dtype)
        if not self.specs:
            raise AdapterMismatch(f"{who}: trainer.lora.targets {list(spec.targets)} name no linear layer of the model")
        self.layers = {name: module for name, module in targeted(model, spec)}
        self.base = {name: m.weight.detach().clone() for name, m in self.layers.items()}
        # Where a sync lands: one buffer per tensor, in the engine's dtype (B zero: W0 as loaded).
        self.received = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=self.base[s.name.rsplit(".", 2)[0]].device)
                         for s in self.specs}

    def check(self, tensors: dict[str, Any]) -> None:
        """``AdapterMismatch`` naming the first tensor that is missing, unexpected or misshapen."""
        want = {s.name: s.shape for s in self.specs}
        missing = [n for n in want if n not in tensors]
        if missing:
            raise AdapterMismatch(f"{self.who}: the sync lacks adapter tensor {missing[0]} ({len(missing)} of {len(want)} missing): "
                                  "the adapter did not arrive, and the base weights would be served as the policy")
        for n, t in tensors.items():
            if n not in want:
                raise AdapterMismatch(f"{self.who}: the sync holds {n}, which is not an adapter tensor of this engine's trainer.lora")
            if tuple(t.shape) != want[n]:
                raise AdapterMismatch(f"{self.who}: adapter tensor {n}: the sync has {list(t.shape)}, this engine expects {list(want[n])}")

    def apply(self, tensors: dict[str, Any]) -> None:
        """Check ``tensors`` (numpy or torch, any float dtype), take them, and merge."""
        import numpy as np
        import torch

        self.check(tensors)
        with torch.no_grad():
            for n, t in tensors.items():
                self.received[n].copy_(t if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t)))
        self.merge()

    def merge(self) -> None:
        """Every targeted weight := W0 + scale B A (float32 arithmetic, cast to the engine's dtype)."""
        import torch

        with torch.no_grad():
            for name, module in self.layers.items():
                a = self.received[f"{name}.lora_A.weight"].float()
                b = self.received[f"{name}.lora_B.weight"].float()
                module.weight.copy_(self.base[name].float() + self.scale * (b @ a))
