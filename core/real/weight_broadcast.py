"""Weights from the trainer to the engines by collective broadcast, bucket by bucket, in the
engines' dtype, loaded in place: no file, no object-store hop, no fp32 copy of the model.

The group is stateless: a ``TCPStore`` served by the trainer (rank 0, on a free port of its
node) and a process group of the device's backend (core/real/device.py) built on a prefix of
it, never torch.distributed's default group, which vLLM initializes for itself in the
engine's process. The GPU path (buckets on the device) is written for GPUs but has not run
on one (docs/gpu.md).

One sync (a *ticket*, numbered ``seq``) runs in three steps, all through the store:

1. Roll call: every engine that takes part writes the same ``members`` list (the rollout side
   names them: engines up at the sync, and engines back from a restart, ``regroup``).
2. The source answers with the group: the current one if its members are the same, else a new
   one under a fresh prefix, which every member joins (rank = 1 + position in ``members``).
   At a group's setup the source's manifest (name, shape, dtype of every tensor, in order) is
   checked by every receiver against its own; a mismatch is one error naming the tensor.
3. Buckets: tensors in manifest order are packed into buckets of at most ``bucket_bytes`` (a
   larger tensor goes alone), each broadcast and unpacked as views into the receiver's
   parameters. The source casts each tensor into the bucket as it packs it, so its extra
   memory is one bucket.

A restarted engine (a new process) is not in any group: it joins the next sync's new group
(``regroup``). A restarted trainer serves a new store: every engine sees a new address and
joins the new group.

torch is imported on use: the ray runtime imports this module in processes that never move a
weight (the driver).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Optional

from core.api import CollectiveTicket
from core.model.faults import CollectiveBroken
from core.real.device import process_group

log = logging.getLogger(__name__)

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
POLL_S = 0.002  # how often the source looks for the roll call while the receivers may skip the sync


class ManifestMismatch(ValueError):
    """The source's tensors and a receiver's differ (name, shape or dtype)."""


@contextlib.contextmanager
def broken_as_collective(who: str) -> Iterator[None]:
    """What the collective backend or the store raise when a member died or hung mid-sync, as
    ``CollectiveBroken``: the caller sends the sync again to those still up. A manifest
    mismatch is not one: it would fail again."""
    try:
        yield
    except (ManifestMismatch, CollectiveBroken):
        raise
    except (RuntimeError, TimeoutError) as exc:
        raise CollectiveBroken(who, f"{type(exc).__name__}: {exc}") from exc


def _torch():
    import torch  # imported on use: see the module docstring

    return torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # a key of ITEMSIZE

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Bucket:
    """Tensors broadcast together: byte ``offsets[i]`` of the bucket starts ``specs[i]``."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; refuses what a bucket cannot carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {name} cannot be broadcast (one of {sorted(ITEMSIZE)})")
    return name


def manifest_of(named: Iterable[tuple[str, Any]], dtype: Optional[str] = None) -> list[TensorSpec]:
    """The specs of ``named`` tensors in their order; ``dtype``: sent as that dtype (the
    engines'), else as each tensor's own."""
    return [TensorSpec(n, tuple(int(d) for d in t.shape), dtype or dtype_name(t.dtype)) for n, t in named]


def group_prefix(seq: int) -> str:
    """The store prefix of the group formed at sync ``seq``."""
    return f"g{seq}/"


def manifest_json(manifest: list[TensorSpec]) -> str:
    return json.dumps([[s.name, list(s.shape), s.dtype] for s in manifest])


def manifest_from_json(text: str) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(shape), dt) for n, shape, dt in json.loads(text)]


def check_manifest(sent: list[TensorSpec], expected: list[TensorSpec], who: str) -> None:
    """Raise ``ManifestMismatch`` naming the first tensor that differs."""
    mine = {s.name: s for s in expected}
    theirs = {s.name for s in sent}
    for s in sent:
        e = mine.get(s.name)
        if e is None:
            raise ManifestMismatch(f"{who}: the trainer sends {s.name}, which this engine does not have")
        if e.shape != s.shape or e.dtype != s.dtype:
            raise ManifestMismatch(
                f"{who}: tensor {s.name}: the trainer sends {list(s.shape)} {s.dtype}, this engine has {list(e.shape)} {e.dtype}"
            )
    for e in expected:
        if e.name not in theirs:
            raise ManifestMismatch(f"{who}: tensor {e.name} of this engine is not sent by the trainer")


def plan_buckets(manifest: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Manifest order, each bucket at most ``bucket_bytes``; a larger tensor is a bucket alone.
    Offsets are aligned to 8 bytes so that every view is aligned for its dtype."""
    buckets: list[Bucket] = []
    specs: list[TensorSpec] = []
    offsets: list[int] = []
    end = 0

    def close() -> None:
        nonlocal specs, offsets, end
        if specs:
            buckets.append(Bucket(tuple(specs), tuple(offsets), end))
        specs, offsets, end = [], [], 0

    for s in manifest:
        start = -(-end // 8) * 8
        if specs and start + s.nbytes > bucket_bytes:
            close()
            start = 0
        specs.append(s)
        offsets.append(start)
        end = start + s.nbytes
        if end >= bucket_bytes:
            close()
    close()
    return buckets


def views(buf: Any, bucket: Bucket) -> list[tuple[str, Any]]:
    """The bucket's tensors as views of ``buf`` (uint8, at least ``bucket.nbytes`` long)."""
    torch = _torch()
    out = []
    for s, off in zip(bucket.specs, bucket.offsets):
        out.append((s.name, buf[off : off + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)))
    return out


def pack(buf: Any, bucket: Bucket, tensors: dict[str, Any]) -> None:
    """Copy each of the bucket's tensors into ``buf``, cast to the bucket's dtype on the way."""
    torch = _torch()
    with torch.no_grad():
        for name, view in views(buf, bucket):
            view.copy_(tensors[name])


# -- the group ------------------------------------------------------------------------------
def _store(host: str, port: int, master: bool, timeout_s: float) -> Any:
    import datetime

    torch = _torch()
    return torch.distributed.TCPStore(
        host, port, is_master=master, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
        use_libuv=True,
    )


class Communicator:
    """A broadcast group of ``world`` ranks on a prefix of a store, on the device's collective
    backend (core/real/device.py)."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int, device: str, timeout_s: float) -> None:
        torch = _torch()
        self.rank, self.world, self.device = rank, world, device
        # Not run on a GPU yet (docs/gpu.md). vLLM's PyNcclCommunicator is the alternative
        # where torch's collectives and vLLM's would clash.
        self.pg = process_group(torch.distributed.PrefixStore(prefix, store), rank, world, device, timeout_s)

    def broadcast(self, tensor: Any) -> None:
        self.pg.broadcast(tensor, 0).wait()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # a peer already gone: nothing to tear down with it
                pass
        self.pg = None


def formed(make: Callable[[], Communicator], answered: threading.Event, timeout_s: float, members: tuple[str, ...]) -> Communicator:
    """``make()``, the source's side of a new group, given up on once every member's call is
    over without it (``CollectiveBroken``) or after ``timeout_s``. The CPU backend's rendezvous waits with
    no end for a member that checked in and died before connecting (seen: a node lost at that
    moment held the trainer for ten minutes, past the backend's own timeout), so it runs in a thread
    of its own; a group that thread makes after it was given up on is closed."""
    lock = threading.Lock()
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            made = make()
        except BaseException as exc:  # handed to the waiting thread
            made, box["error"] = None, exc
        with lock:  # done is set under the lock: the waiter either takes the group or abandons it
            if box.get("abandoned"):
                if made is not None:
                    made.close()
                return
            box["group"] = made
            done.set()

    threading.Thread(target=run, name="broadcast-group", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(POLL_S * 25):
        over = answered.is_set()
        if over or time.monotonic() > deadline:
            with lock:
                if done.is_set():
                    break
                box["abandoned"] = True
            if over:
                raise CollectiveBroken("trainer", f"a member of {', '.join(members)} left while the group formed")
            raise TimeoutError(f"weight broadcast: members {', '.join(members)} did not connect within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["group"]


@dataclass(frozen=True)
class BroadcastTicket(CollectiveTicket):
    """What ParamSync hands the rollout side for one collective sync. The rollout side fills in
    ``members`` (the engines that take part) before the engines see it."""

    host: str
    port: int
    seq: int
    version: int
    bucket_bytes: int
    timeout_s: float
    members: tuple[str, ...] = ()
    regroup: bool = False  # a member is a new process (restarted): a new group for all

    def addressed(self, members: list[str], regroup: bool) -> "BroadcastTicket":
        return replace(self, members=tuple(members), regroup=regroup)


@dataclass
class Membership:
    """An engine's place in the group one sync uses."""

    host: str
    port: int
    prefix: str
    rank: int
    world: int


@dataclass
class SendStats:
    """What the source did in its last sync, for the report and for the tests."""

    bytes: int = 0
    buckets: int = 0
    regrouped: bool = False
    setup_s: float = 0.0  # roll call, group setup and manifest check
    broadcast_s: float = 0.0
    buffer_bytes: list[int] = field(default_factory=list)  # every staging buffer the source allocated


class BroadcastSource:
    """Rank 0, in the trainer's process: serves the store, forms groups, sends buckets."""

    def __init__(self, host: str, *, bucket_bytes: int, device: str = "cpu", timeout_s: float = 60.0) -> None:
        self.host = host
        self.bucket_bytes = int(bucket_bytes)
        self.device = device
        self.timeout_s = timeout_s
        self.store = _store(host, 0, True, timeout_s)
        self.port = int(self.store.port)
        self.seq = 0
        self.group: Optional[Communicator] = None
        self.members: tuple[str, ...] = ()
        self.prefix = ""
        self.stats = SendStats()
        # Called with each staging buffer's size before it is allocated: the tests count them.
        self.on_alloc: Optional[Callable[[int], None]] = None

    def ticket(self, version: int) -> BroadcastTicket:
        self.seq += 1
        return BroadcastTicket(self.host, self.port, self.seq, version, self.bucket_bytes, self.timeout_s)

    def send(self, ticket: BroadcastTicket, tensors: Callable[[], dict[str, Any]], manifest: list[TensorSpec],
             answered: threading.Event) -> SendStats:
        """Broadcast ``tensors()`` (read once the group is up) as ``manifest`` to the members
        of ``ticket``'s roll call. ``answered``: every engine's call is over (loaded, failed or
        lost). Set before any roll call, nobody takes part (the rollout side skipped the sync)
        and nothing is sent; set while members are awaited, one of them is not coming."""
        t0 = time.perf_counter()
        self.stats = st = SendStats()
        key = f"sync{ticket.seq}/members"
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            if answered.is_set() and not self.store.check([key]):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight broadcast: no engine answered the roll call of sync {ticket.seq} in {self.timeout_s:g} s")
            time.sleep(POLL_S)
        call = json.loads(self.store.get(key))
        members = tuple(call["members"])
        try:
            with broken_as_collective("trainer"):
                self._send(ticket, members, call["regroup"], tensors, manifest, st, t0, answered)
        except CollectiveBroken:
            self.close()  # the next sync forms a new group of those still up
            raise
        return st

    def _send(self, ticket: BroadcastTicket, members: tuple[str, ...], regroup: bool, tensors: Callable[[], dict[str, Any]],
              manifest: list[TensorSpec], st: SendStats, t0: float, answered: threading.Event) -> None:
        if self.group is None or regroup or members != self.members:
            self._regroup(ticket, members, manifest, answered)
            st.regrouped = True
        else:
            self.store.set(f"sync{ticket.seq}/group", json.dumps({"prefix": self.prefix, "world": len(members) + 1}))
        st.setup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        src = tensors()
        buckets = plan_buckets(manifest, self.bucket_bytes)
        torch = _torch()
        size = max((b.nbytes for b in buckets), default=0)
        if self.on_alloc is not None:
            self.on_alloc(size)
        st.buffer_bytes.append(size)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        for b in buckets:
            pack(buf, b, src)
            self.group.broadcast(buf[: b.nbytes])
            st.bytes += b.nbytes
            st.buckets += 1
        del buf
        st.broadcast_s = time.perf_counter() - t1

    def _regroup(self, ticket: BroadcastTicket, members: tuple[str, ...], manifest: list[TensorSpec],
                 answered: threading.Event) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        prefix = group_prefix(ticket.seq)
        world = len(members) + 1
        self.store.set(prefix + "manifest", manifest_json(manifest))
        self.store.set(f"sync{ticket.seq}/group", json.dumps({"prefix": prefix, "world": world}))
        # Every receiver checks the manifest before anyone joins: a mismatch fails the sync
        # at once, with its message, instead of leaving the others waiting in a rendezvous.
        keys = [f"{prefix}check/{r}" for r in range(1, world)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            # A member lost after the roll call never checks in: every call is over without it.
            if answered.is_set() and not self.store.check(keys):
                raise CollectiveBroken("trainer", f"a member of {', '.join(members)} left before joining")
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight broadcast: members {', '.join(members)} did not check in within {self.timeout_s:g} s")
            time.sleep(POLL_S)
        errors = [self.store.get(k).decode() for k in keys]
        errors = [e for e in errors if e != "ok"]
        if errors:
            raise ManifestMismatch("; ".join(errors))
        # On a connection of its own: a rendezvous given up on must not hold the source's store.
        own = _store(self.host, self.port, False, self.timeout_s)
        self.group = formed(lambda: Communicator(own, prefix, 0, world, self.device, self.timeout_s), answered, self.timeout_s, members)
        self.members, self.prefix = members, prefix
        log.info("weight broadcast: group %s of %d ranks (%s)", prefix, world, ", ".join(members))

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class RollCall:
    """An engine's side of steps 1-2, in the engine's process: which group a ticket uses, and
    whether this engine must join it first."""

    def __init__(self, name: str, timeout_s: float = 60.0) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._store: Any = None
        self._address: Optional[tuple[str, int]] = None
        self.current: Optional[Membership] = None  # the group this engine is in

    def answer(self, ticket: BroadcastTicket) -> tuple[Membership, bool]:
        """(the sync's group, True if this engine must join it)."""
        if self._address != (ticket.host, ticket.port):  # a new trainer: a new store
            self._store = _store(ticket.host, ticket.port, False, self.timeout_s)
            self._address = (ticket.host, ticket.port)
            self.current = None
        store = self._store
        store.set(f"sync{ticket.seq}/members", json.dumps({"members": list(ticket.members), "regroup": ticket.regroup}))
        key = f"sync{ticket.seq}/group"
        store.wait([key])
        group = json.loads(store.get(key))
        m = Membership(ticket.host, ticket.port, group["prefix"], ticket.members.index(self.name) + 1, group["world"])
        join = self.current is None or (self.current.prefix, self.current.port) != (m.prefix, m.port)
        if join and m.prefix != group_prefix(ticket.seq):
            # A group formed before this process was (the sync was not addressed as a regroup):
            # its rank is a dead process's. Broken at once, instead of a receive that never ends.
            raise RuntimeError(f"{self.name} is not in the trainer's group {m.prefix} (it was restarted since it formed)")
        self.current = m
        return m, join


class GroupMember:
    """A receiver's rank in the group, in the process that holds the parameters (the engine's,
    or vLLM's worker): checks the manifest, joins, receives buckets."""

    def __init__(self, m: Membership, expected: list[TensorSpec], *, device: str = "cpu", timeout_s: float = 60.0,
                 who: str = "engine") -> None:
        self.membership = m
        store = _store(m.host, m.port, False, timeout_s)
        sent = manifest_from_json(store.get(m.prefix + "manifest").decode())
        try:
            check_manifest(sent, expected, who)
        except ManifestMismatch as exc:
            store.set(f"{m.prefix}check/{m.rank}", str(exc))
            raise
        store.set(f"{m.prefix}check/{m.rank}", "ok")
        self.manifest = sent
        self.device = device
        self.group = Communicator(store, m.prefix, m.rank, m.world, device, timeout_s)
        self._store = store  # the group's rendezvous store stays open with it
        self.received: dict[str, str] = {}  # name -> sha256 of the bytes received, when ``checksums``
        self.checksums = False

    def receive(self, bucket_bytes: int, load: Callable[[list[tuple[str, Any]]], None], *,
                fresh: bool = False, direct: Optional[Callable[[TensorSpec], Any]] = None) -> int:
        """Receive every bucket; ``load(views)`` takes each bucket's tensors (views of the
        buffer). ``fresh``: a new buffer per bucket, for a ``load`` that keeps views past its
        return (vLLM buffers a layer's tensors until the layer is complete). ``direct(spec)``:
        the destination of a tensor that is a bucket alone, as a flat uint8 view, to receive
        into with no buffer at all (None: through the buffer). Returns the bytes received."""
        torch = _torch()
        buckets = plan_buckets(self.manifest, bucket_bytes)
        buf = None
        total = 0
        for b in buckets:
            if direct is not None and len(b.specs) == 1:
                target = direct(b.specs[0])
                if target is not None:
                    self.group.broadcast(target)
                    if self.checksums:
                        self._sum(b.specs[0].name, target)
                    total += b.nbytes
                    continue
            if buf is None or fresh or buf.numel() < b.nbytes:
                buf = None  # freed before the next one is made: one bucket at a time
                buf = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
            part = buf[: b.nbytes]
            self.group.broadcast(part)
            vs = views(part, b)
            if self.checksums:
                for name, v in vs:
                    self._sum(name, v)
            load(vs)
            total += b.nbytes
        return total

    def _sum(self, name: str, t: Any) -> None:
        self.received[name] = sha256_of(t)

    def close(self) -> None:
        self.group.close()


def sha256_of(t: Any) -> str:
    """The checksum of a tensor's bytes (as laid out contiguously): what bit for bit means."""
    import hashlib

    torch = _torch()
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
