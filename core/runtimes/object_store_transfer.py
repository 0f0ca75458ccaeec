"""ObjectStoreTransfer: the weights go into the object store once per version, and every
consumer (LLM engines, env samplers) gets that one reference (seed 001's broadcast).

``put`` is passed in (``ray.put`` on a cluster) so that this module does not import Ray.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable


class ObjectStoreTransfer:
    """ParamSync's WeightTransfer over an object store: one ``put`` per version."""

    def __init__(self, backend: Any, put: Callable[[Any], Any]) -> None:
        self.backend = backend
        self.put = put
        self.latest: tuple[int, list] = (0, [])
        self.bytes = 0  # of the latest version's weights
        self.put_s = 0.0  # in ``put`` over the run: the serialization into the store

    async def send(self, version: int) -> list:
        weights = await asyncio.to_thread(self.backend.weights)
        self.bytes = sum(w.nbytes for w in weights.values())
        t0 = time.perf_counter()
        ref = self.put(weights)
        self.put_s += time.perf_counter() - t0
        self.latest = (version, [ref])
        return [ref]
