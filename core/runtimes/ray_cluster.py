"""The ray runtime on a cluster of several nodes: where each actor runs, pinning the
controller to the driver's node, taking a whole node down (a fault), and what a node needs
to run asyncrl's actors (the project's code, the model directory).

A node is lost as a preempted host is: its raylet is killed from a task pinned to that node,
and with it every process of the node (its workers exit when their raylet is gone, its object
store goes with it); the cluster's health checks then declare the node dead and Ray restarts
its actors elsewhere, on placement-group bundles it reschedules. This works the same on a real
cluster, where the test utility's ``Cluster.remove_node`` does not exist.

The model directory is resolved on each node: a path the node sees is used as it is;
otherwise the driver's copy, shipped once through the object store, is unpacked into a
directory asyncrl creates and stamps on that node (``core.model.owned``) and reused by every
actor there; a node that has neither fails with one error naming it, the path and the fix.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any

from core.model.config import Scenario
from core.model.owned import is_owned, make_owned

log = logging.getLogger(__name__)

MODEL_CACHE_KIND = "model-cache"
# What asyncrl's actors import on another node: its packages, the built extensions inside ext/.
CODE_PACKAGES = ("core", "ext")
# Sources and build leftovers a worker never imports (the .so files are what it loads).
CODE_EXCLUDES = ["*.pyx", "*.pxd", "*.c", "*.cpp", "*.html", "__pycache__", "build"]


def _ray():
    import ray  # imported on use: a sim run never pays for importing Ray

    return ray


def node_id() -> str:
    """The node this process runs on (hex id)."""
    return _ray().get_runtime_context().get_node_id()


def on_node(node: str) -> Any:
    """A scheduling strategy that puts an actor or task on ``node`` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc): a node's workers and what they started."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_own_raylet() -> None:
    """In a task on the node to take down: SIGKILL its raylet and every process under it (its
    workers and theirs, this one last), as a host that goes away takes them all at once. A
    worker left alive would hold its peers in a collective until their timeout."""
    raylet = int(os.environ.get("RAY_RAYLET_PID") or os.getppid())
    log.warning("taking this node down: SIGKILL to its raylet (pid %d) and its processes", raylet)
    me = os.getpid()
    for pid in [raylet, *_descendants(raylet)]:
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def kill_node(node: str) -> None:
    """Take ``node`` down at once, as a preempted host goes: every process on it dies. Returns
    without waiting; the cluster notices through its health checks."""
    ray = _ray()
    if node == node_id():
        raise ValueError(f"node {node} is the driver's own node: taking it down ends the run")
    ray.remote(_kill_own_raylet).options(num_cpus=0, scheduling_strategy=on_node(node), max_retries=0).remote()


def code_env(root: Path) -> dict:
    """The runtime_env part that ships asyncrl's packages (with the extensions built in place)
    to a cluster's workers: ``py_modules`` uploaded once per content, cached by Ray per node."""
    return {"py_modules": [str(root / p) for p in CODE_PACKAGES], "excludes": list(CODE_EXCLUDES)}


# -- the model directory on every node ---------------------------------------------------------
def pack_model(path: str) -> dict:
    """The model directory as {relative path: bytes}: what is shipped once to the nodes that
    cannot see it, with a digest of it to cache it under."""
    root = Path(path)
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    digest = hashlib.sha256()
    for name, data in files.items():
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return {"source": str(root), "digest": digest.hexdigest()[:16], "files": files}


def cache_root() -> Path:
    """Where a node keeps the model directories shipped to it (per user, out of the way)."""
    return Path(os.environ.get("ASYNCRL_MODEL_CACHE") or Path(tempfile.gettempdir()) / f"asyncrl-models-{os.getuid()}")


def local_model_dir(path: str, shipped: tuple = ()) -> str:
    """The directory this node loads the model ``path`` from: ``path`` if this node sees it,
    else the shipped copy (``shipped``: (a reference to ``pack_model``'s result,), or ()),
    unpacked once into a stamped directory of this node's cache."""
    if Path(path).is_dir():
        return path
    if not shipped:
        raise FileNotFoundError(
            f"node {_node_or_host()}: the model directory {path} is not there and none was shipped; "
            "fix: put it at that path on every node (shared storage, or a copy), or set ray.ship_model: true"
        )
    pack = shipped[0] if isinstance(shipped[0], dict) else _ray().get(shipped[0])
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    # The actors of one node resolve it at once: one unpacks, the others wait and reuse it.
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _cached(root, pack)


def node_scenario(sc: Scenario, shipped: tuple) -> Scenario:
    """``sc`` as this node runs it: loading the model from where this node has it."""
    here = local_model_dir(sc.real_model_path, shipped)
    return sc if here == sc.real_model_path else sc.with_model_dir(here)


def _cached(root: Path, pack: dict) -> str:
    for entry in root.iterdir():
        model = entry / "model"
        if entry.name.startswith(pack["digest"]) and is_owned(entry, MODEL_CACHE_KIND) and (model / ".complete").is_file():
            return str(model)
    entry = make_owned(root, f"{pack['digest']}-", MODEL_CACHE_KIND)
    model = entry / "model"
    for name, data in pack["files"].items():
        dest = model / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    (model / ".complete").write_text(pack["source"] + "\n")  # a half-written copy is never reused
    log.info("model %s shipped to node %s: cached in %s", pack["source"], _node_or_host(), model)
    return str(model)


def _node_or_host() -> str:
    ray = _ray()
    return node_id() if ray.is_initialized() else socket.gethostname()

