"""vLLM's side of a weight broadcast: a worker extension (vLLM's ``worker_extension_cls``) whose
methods vLLM mixes into its Worker, reached through ``collective_rpc``.

``asyncrl_join`` joins the trainer's group (core/real/weight_broadcast.py) after checking the
trainer's manifest against this engine's model: the checkpoint's names and shapes (the
safetensors headers of the directory vLLM loaded) in the engine's dtype.

``asyncrl_receive`` loads every bucket through vLLM's layerwise reload, the path vLLM's own
weight-transfer engines take: ``model.load_weights`` after start fails on CPU, where linear
weights are repacked (oneDNN) and the checkpoint-shaped parameters are gone. The layerwise
reload restores each layer's checkpoint-shaped parameters, loads the tensors in, processes the
layer again (repacking, fusing q/k/v and gate/up) and copies the result into the tensors the
engine runs on, so CUDA graphs and kernels keep their storage. It holds a layer's tensors
until the layer is complete, so each bucket is a fresh buffer (never overwritten under a
layer waiting for its last tensor); peak extra memory is the buckets of one incomplete layer
plus one layer in checkpoint form.

A tied LM head is loaded explicitly from the embedding's tensor: vLLM repacks the head apart,
and a reload without it would leave the head on the old weights.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from core.real.weight_broadcast import GroupMember, Membership, TensorSpec, dtype_name, sha256_of

log = logging.getLogger(__name__)

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def checkpoint_manifest(model_dir: str | Path, dtype: str) -> list[TensorSpec]:
    """Names and shapes of the directory's safetensors, in ``dtype``; a tied LM head is not
    stored apart, as the trainer does not send it apart."""
    from safetensors import safe_open

    specs = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                specs.append(TensorSpec(name, tuple(st.get_slice(name).get_shape()), dtype))
    return specs


class BroadcastReceiverExtension:
    """Mixed into vLLM's Worker: ``self.model_runner`` and ``self.vllm_config`` are the Worker's."""

    _asyncrl_member: Any = None

    def asyncrl_join(self, m: dict, timeout_s: float, who: str, model_dir: str) -> None:
        """Join the group ``m`` after checking the trainer's manifest against the checkpoint in
        ``model_dir``: not vLLM's ``model_config.model``, which a reload from a file (a restarted
        engine's catch-up through the object store) points at that file's directory."""
        cfg = self.vllm_config.model_config
        dtype = dtype_name(cfg.dtype)
        expected = checkpoint_manifest(model_dir, dtype)
        if getattr(cfg.hf_config, "tie_word_embeddings", False):
            expected = [s for s in expected if s.name != HEAD]
        if self._asyncrl_member is not None:
            self._asyncrl_member.close()
            self._asyncrl_member = None
        device = str(getattr(self.model_runner, "device", "cpu"))
        device = "cpu" if device.startswith("cpu") else device
        self._asyncrl_member = GroupMember(Membership(**m), expected, device=device, timeout_s=timeout_s, who=who)

    def asyncrl_receive(self, bucket_bytes: int, checksums: bool = False) -> dict:
        """Receive one sync's buckets into the model; returns the bytes and, with
        ``checksums``, the sha256 of every tensor as it arrived (for the tests)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.get_model()
        cfg = self.vllm_config.model_config
        tied = bool(getattr(cfg.hf_config, "tie_word_embeddings", False))
        member = self._asyncrl_member
        member.checksums = checksums

        def load(views: list) -> None:
            if tied:
                views = views + [(HEAD, v) for n, v in views if n == EMBED]
            model.load_weights(views)

        initialize_layerwise_reload(model)
        try:
            total = member.receive(bucket_bytes, load, fresh=True)
        finally:
            finalize_layerwise_reload(model, cfg)
        return {"bytes": total, "checksums": dict(member.received) if checksums else {}}

    def asyncrl_parameter_checksums(self, shapes: dict) -> dict:
        """sha256 of the parameters named in ``shapes`` that vLLM keeps in checkpoint form (not
        repacked: embeddings, norms), cut to the checkpoint's shape (vLLM pads the vocabulary)."""
        out = {}
        for n, p in self.model_runner.get_model().named_parameters():
            shape = shapes.get(n)
            if shape is None or p.dim() != len(shape) or any(a < b for a, b in zip(p.shape, shape)):
                continue
            out[n] = sha256_of(p[tuple(slice(0, d) for d in shape)])
        return out
