"""BroadcastTransfer: ParamSync's weight transfer by collective broadcast, beside
ObjectStoreTransfer. The trainer is rank 0 of a group with every engine
(core/real/weight_broadcast.py); nothing goes through the object store, no file is written and
the trainer's float32 weights are cast bucket by bucket into the engines' dtype.

A broadcast needs its receivers at the same time as its sender, so ParamSync gives the rollout
side a ticket and runs ``send`` while the engines receive (``core.api.CollectiveTransfer``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Optional

from core.api import CollectiveTransfer
from core.real.weight_broadcast import BroadcastSource, BroadcastTicket, SendStats, manifest_of


class BroadcastTransfer(CollectiveTransfer):
    """ParamSync's collective transfer by broadcast from the trainer's process."""

    def __init__(self, backend: Any, host: str, *, bucket_bytes: int, dtype: str, device: str = "cpu",
                 timeout_s: float = 60.0, put: Optional[Callable[[Any], Any]] = None, publish_every: int = 0) -> None:
        self.backend = backend
        self.dtype = dtype
        with backend.lock:
            self.manifest = manifest_of(backend.parameters().items(), dtype)
        self.source = BroadcastSource(host, bucket_bytes=bucket_bytes, device=device, timeout_s=timeout_s)
        # Evaluators read weights from the object store: every ``publish_every`` versions the
        # weights are put there too, after the broadcast (0: never).
        self.put, self.publish_every = put, publish_every
        self.latest: tuple[int, list] = (0, [])
        self.bytes = 0  # of the latest sync, in the engines' dtype
        self.stats: list[SendStats] = []

    def ticket(self, version: int) -> BroadcastTicket:
        return self.source.ticket(version)

    async def send(self, ticket: BroadcastTicket, receiving: "asyncio.Future") -> None:
        """Broadcast while ``receiving`` (the engines' loads) runs; returns once every bucket is
        out, or at once when the rollout side ends ``receiving`` without a roll call."""
        answered = threading.Event()
        receiving.add_done_callback(lambda _: answered.set())
        st = await asyncio.to_thread(self._send, ticket, answered)
        self.stats.append(st)
        if st.bytes:
            self.bytes = st.bytes
        if self.put is not None and self.publish_every and ticket.version % self.publish_every == 0:
            weights = await asyncio.to_thread(self.backend.weights)
            self.latest = (ticket.version, [self.put(weights)])

    def _send(self, ticket: BroadcastTicket, answered: threading.Event) -> SendStats:
        exported = []

        def tensors():
            # Read once the group is up; a sharded trainer's ranks gather each tensor as it is packed.
            exported.append(self.backend.export())
            return exported[-1]

        with self.backend.lock:
            try:
                return self.source.send(ticket, tensors, self.manifest, answered)
            finally:
                for e in exported:
                    e.finish()  # a sharded trainer's ranks end their gathers together, even after a broken send

    def close(self) -> None:
        self.source.close()
