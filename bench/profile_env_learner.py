"""Where the env pipeline's learner spends its time: py-spy samples, grouped by what the frames
belong to (ext.replay's add / sample / update_priorities, the learner's forward, backward and Adam,
the codec, gymnasium, Ray and asyncio), in sync and in async mode, on both backends of
``ext.replay``.

    python bench/profile_env_learner.py [--env-steps N] [--rate HZ] [--native] [--out DIR]
                                        [--modes sync async] [--backends ext ref]

- **sync** (``core/runtimes/local_env.py``'s ``run_sync``: sampler, replay and learner take turns in
  one thread): ``py-spy record --format raw`` runs a child Python that runs the loop.
- **async** (``run_async`` on a 2-CPU Ray instance, started in a child Python): the parent
  finds the child's ``ray::LearnerHost``, ``ray::TransitionReplay`` and ``ray::SamplerHost``
  worker processes and attaches one ``py-spy record --pid`` to each, until the run kills them.

Both run the scenario's defaults (``scenarios/cartpole-dqn.yaml``: 32 samples per insert, so
the learner is the bottleneck) for ``--env-steps`` without stopping at the target, and evaluate
once, at the end, one episode. ``ASYNCRL_PUREPYTHON=1`` in the child's environment selects the
pure-Python reference of ``ext.replay`` (``ref``), and ``0`` demands the compiled one (``ext``); a
Ray instance's workers inherit it from the child that starts it.

Attribution. A sample is charged to the first of these its stack holds (``categorize``):
ext.replay (a frame in ``ext/_replay*``, or, for the compiled extension, whose ``def`` methods
make no Python frame, the line of ``core/env/transition_replay.py`` that calls ``self.buffer``);
the codec; the learner's update, split by the line of ``DQNLearner.update`` it is in; the
sampler's policy; gymnasium; the sampler's own Python; the replay's bookkeeping and rate
limiter; Ray and asyncio machinery. Imports and actor construction are left out. py-spy's default
leaves idle threads out, so the shares are of the time a process was busy. ``--native`` adds C
frames (the compiled extension's own functions become visible; the attribution of the sample
does not change).

Not part of ``make test`` or ``make bench``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.report import commit_label, load_average  # noqa: E402

log = logging.getLogger("profile_env_learner")

ROLES = ("LearnerHost", "TransitionReplay", "SamplerHost")
BACKEND_ENV = {"ext": "0", "ref": "1"}

# Category names, in the order tables list them.
REPLAY_ADD, REPLAY_SAMPLE, REPLAY_PRIO, REPLAY_OTHER = (
    "ext.replay add", "ext.replay sample", "ext.replay update_priorities", "ext.replay other")
CATEGORIES = (
    REPLAY_ADD, REPLAY_SAMPLE, REPLAY_PRIO, REPLAY_OTHER,
    "learner: batch to tensors", "learner: forward + loss", "learner: backward", "learner: grad clip",
    "learner: Adam step", "learner: target copy", "learner: priorities out", "learner: weights out",
    "codec", "policy (sampler's forward)", "gymnasium", "sampler python (n-step rows, chunk)",
    "replay bookkeeping + rate limiter", "learner loop (python)", "ray / asyncio / serialization", "other",
)
STARTUP = "startup (imports, construction)"
WAITING = "waiting"
# Where a thread of a Ray worker blocks: its innermost Python frame is one of these and below it
# is C (a condition variable, epoll). py-spy's own idle detection counts these threads busy
# here; ``--native`` shows pthread_cond_wait / epoll_wait under every one of them.
WAIT_LEAVES = (("main_loop", "ray/_private/worker.py"), ("wait", "threading.py"), ("run", "threading.py"),
               ("select", "selectors.py"))

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_frame(frame: str) -> tuple[str, str, int]:
    """(function, file, line) of one py-spy frame ``Class.func (file:line)``; the function without
    its class; line 0 when absent."""
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip(), "", 0
    return m["func"].rsplit(".", 1)[-1], m["file"], int(m["line"] or 0)


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's ``--format raw`` (collapsed stacks): [(frames root first, samples)]."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            out.append((stack.split(";") if stack else [], int(count)))
    return out


@functools.lru_cache(maxsize=None)
def _source_line(file: str, line: int) -> str:
    """The text of ``file:line`` when ``file`` is a project file, else ''."""
    p = Path(file)
    if not p.is_absolute():
        p = ROOT / p
    try:
        lines = p.read_text().splitlines()
    except OSError:
        return ""
    return lines[line - 1] if 0 < line <= len(lines) else ""


def _is(file: str, *parts: str) -> bool:
    f = file.replace("\\", "/")
    return any(p in f for p in parts)


_REPLAY_METHODS = (("add", REPLAY_ADD), ("sample", REPLAY_SAMPLE), ("update_priorities", REPLAY_PRIO))


def _replay_category(func: str) -> str:
    f = func.lower()
    for name, cat in _REPLAY_METHODS:
        if f == name or f.endswith("." + name) or f"_{name}" in f and "replaybuffer" in f:
            return cat
    return REPLAY_OTHER


def _learner_line(text: str) -> str:
    t = text.strip()
    if "backward(" in t or "backward_into(" in t:
        return "learner: backward"
    if "clip_grad_norm_" in t or "clip_flat_" in t:
        return "learner: grad clip"
    if "opt.step" in t or "adam_step(" in t or "zero_grad" in t or "grads.zero_" in t:
        return "learner: Adam step"
    if "target.load_state_dict" in t:
        return "learner: target copy"
    if t.startswith("prio =") or "np.abs(td" in t or t.startswith("return prio"):
        return "learner: priorities out"
    if "torch.tensor(" in t or "_tensor(" in t:
        return "learner: batch to tensors"
    return "learner: forward + loss"


def categorize(frames: list[str]) -> str:
    """The category of one stack (frames root first); see the module docstring for the order."""
    parsed = [parse_frame(f) for f in frames]
    python = [p for p in parsed if p[1].endswith(".py") or p[1].startswith("<frozen")]
    if not python:
        return WAITING  # a thread with no Python frame (--native: Ray's C++ threads)
    leaf_fn, leaf_file, _ = python[-1]
    if any(leaf_fn == fn and leaf_file.endswith(f) for fn, f in WAIT_LEAVES):
        return WAITING
    files = [p[1] for p in parsed]
    funcs = [p[0] for p in parsed]
    if any(fn in ("_find_and_load", "_call_with_frames_removed") for fn in funcs) or any(
            fn in ("__init__",) and _is(f, "core/runtimes/ray_env_hosts.py", "core/env/transition_replay.py") for fn, f, _ in parsed):
        return STARTUP
    # ext.replay: its pure-Python reference's frames, the compiled extension's C frames (with
    # --native), or the line of transition_replay.py that calls the buffer.
    for fn, f, line in parsed:
        if _is(f, "ext/_replay_ref.py"):
            return _replay_category(fn)
    for fn, f, line in parsed:
        if _is(f, "_replay.pyx", "_replay.c", "ext/_replay.cpython") or "ReplayBuffer" in fn and "__pyx" in fn:
            return _replay_category(fn.split("_", 1)[-1] if fn.startswith("__pyx") else fn)
    for fn, f, line in parsed:
        if _is(f, "core/env/transition_replay.py"):
            text = _source_line(f, line)
            m = re.search(r"self\.buffer\.(add|sample|update_priorities)\(", text)
            if m:
                return dict(_REPLAY_METHODS)[m.group(1)]
    if any(_is(f, "ext/_codec", "ext/codec.py", "core/model/transition_wire.py") for f in files):
        return "codec"
    dqn = [(fn, f, line) for fn, f, line in parsed if _is(f, "core/env/dqn.py")]
    if dqn:
        # The outermost dqn.py frame says which part of the learner or policy this is.
        fn, f, line = dqn[0]
        if fn in ("act", "greedy", "set_weights", "epsilon"):
            return "policy (sampler's forward)"
        if fn in ("weights", "weights_of"):
            return "learner: weights out"
        if fn == "update":
            return _learner_line(_source_line(f, line))
    if any(_is(f, "gymnasium/") for f in files):
        return "gymnasium"
    if any(_is(f, "core/env/sampler.py") for f in files):
        return "sampler python (n-step rows, chunk)"
    if any(_is(f, "core/env/transition_replay.py", "core/env/rate_limiter.py") for f in files):
        return "replay bookkeeping + rate limiter"
    # Below every project frame: Ray's or asyncio's machinery (a call the loop made into Ray, or
    # Ray's event loop and serialization around a method); else the loop's own Python.
    ours = [i for i, f in enumerate(files) if _is(f, "core/", "bench/", "ext/")]
    theirs = [i for i, (fn, f) in enumerate(zip(funcs, files)) if _is(f, "ray/", "_raylet", "asyncio/", "selectors.py", "threading.py",
                                                                       "pickle", "concurrent/futures") or "raylet" in fn]
    if theirs and (not ours or max(theirs) > max(ours)):
        return "ray / asyncio / serialization"
    if ours:
        return "learner loop (python)"
    return "other"


def shares(stacks: Iterable[tuple[list[str], int]], keep: Optional[str] = None) -> tuple[dict[str, int], int, int, int]:
    """(samples per category, samples counted, samples left out, samples waiting). Left out:
    imports and construction, stacks without ``keep`` in any frame when it is given (the sync
    loop: ``run_sync``), and samples with no frame at all (a process starting or ending), which
    nothing attributes. Waiting: a thread blocked in C (``WAIT_LEAVES``)."""
    counts: dict[str, int] = collections.Counter()
    startup = waiting = 0
    for frames, n in stacks:
        if not any(f.strip() for f in frames):
            startup += n
            continue
        if keep is not None and not any(keep in f for f in frames):
            startup += n
            continue
        cat = categorize(frames)
        if cat == STARTUP:
            startup += n
        elif cat == WAITING:
            waiting += n
        else:
            counts[cat] += n
    return dict(counts), sum(counts.values()), startup, waiting


def group(counts: dict[str, int]) -> dict[str, int]:
    """Coarse groups: ext.replay, the learner's torch, everything else."""
    out = collections.Counter()
    for cat, n in counts.items():
        if cat.startswith("ext.replay"):
            out["ext.replay (all)"] += n
        elif cat.startswith("learner: ") and cat not in ("learner: priorities out",):
            out["learner torch (tensors, forward, backward, clip, Adam)"] += n
        else:
            out["rest"] += n
    return dict(out)


# ---- the workloads (child processes) -----------------------------------------------------------------

def _scenario(env_steps: int):
    from core.model.config import with_changes
    from core.model.env_config import EnvScenario

    return with_changes(EnvScenario(), {
        "env.env_steps": env_steps, "env.eval_every": 10 * env_steps, "env.eval_episodes": 1,
    })


def workload(mode: str, env_steps: int, seed: int) -> None:
    """Run one workload in this process; its figures as one JSON line on stdout."""
    import asyncio

    from ext.replay import BACKEND

    sc = _scenario(env_steps)
    t0 = time.perf_counter()
    if mode == "sync":
        from core.runtimes.local_env import run_sync

        curve = asyncio.run(run_sync(sc, seed, stop_at_target=False))
    else:
        from core.runtimes.ray_start import cluster
        from core.runtimes.ray_env import run_async

        with cluster(None, 2):
            curve = run_async(sc, seed, stop_at_target=False)
    print(json.dumps({"mode": mode, "backend": BACKEND, "cpu_s": time.process_time(), "env_steps": curve.replay["env_steps"], "updates": curve.updates,
                      "train_s": curve.train_s, "wall_s": time.perf_counter() - t0, "learner": curve.learner,
                      "insert_blocked_s": curve.replay["insert_blocked_s"], "sample_blocked_s": curve.replay["sample_blocked_s"]}),
          flush=True)


# ---- the parent: runs each workload under py-spy --------------------------------------------------

def _py_spy() -> str:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else "py-spy"


def _child_env(backend: str) -> dict[str, str]:
    env = {**os.environ, "ASYNCRL_PUREPYTHON": BACKEND_ENV[backend], "RAY_AUTH_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _child_cmd(mode: str, env_steps: int, seed: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--workload", mode, "--env-steps", str(env_steps), "--seed", str(seed)]


def _last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the workload printed no result:\n{text[-3000:]}")


def profile_sync(backend: str, env_steps: int, seed: int, rate: int, native: bool, out: Path) -> dict:
    raw = out / f"sync-{backend}{'-native' if native else ''}.txt"
    cmd = [_py_spy(), "record", "--format", "raw", "-o", str(raw), "-r", str(rate), *(["--native"] if native else []),
           "--", *_child_cmd("sync", env_steps, seed)]
    done = subprocess.run(cmd, env=_child_env(backend), capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = _last_json(done.stdout)
    counts, total, startup, waiting = shares(read_raw(raw), keep="run_sync")
    return {**result, "role": "sync (one thread)", "raw": str(raw), "counts": counts, "samples": total, "startup_samples": startup,
            "waiting_samples": waiting, "cpu_s": result.get("cpu_s")}


def _children(pid: int) -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, command line)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        out[int(d.name)] = (ppid, cmd)
    return out


def _cpu_s(pid: int) -> Optional[float]:
    """User + system CPU seconds of a live process, all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descends(pid: int, ancestor: int, procs: dict[int, tuple[int, str]]) -> bool:
    seen = 0
    while pid in procs and seen < 64:
        if pid == ancestor:
            return True
        pid = procs[pid][0]
        seen += 1
    return pid == ancestor


def profile_async(backend: str, env_steps: int, seed: int, rate: int, native: bool, out: Path) -> list[dict]:
    """The async workload in a child; one py-spy per actor process of the child's Ray instance."""
    child = subprocess.Popen(_child_cmd("async", env_steps, seed), env=_child_env(backend), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spies: dict[int, tuple[str, subprocess.Popen, Path]] = {}
    cpu: dict[int, float] = {}  # CPU seconds of each profiled process, last read before it ended
    counters: dict[str, int] = collections.Counter()
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.append(child.stderr.read()), daemon=True)
    reader.start()
    try:
        while child.poll() is None:
            procs = _children(child.pid)
            for pid, (_, cmd) in procs.items():
                role = next((r for r in ROLES if cmd.startswith(f"ray::{r}")), None)
                if role is None or pid in spies or not _descends(pid, child.pid, procs):
                    continue
                raw = out / f"async-{backend}{'-native' if native else ''}-{role}-{counters[role]}.txt"
                counters[role] += 1
                cmd_spy = [_py_spy(), "record", "--format", "raw", "-o", str(raw), "-r", str(rate), "--pid", str(pid),
                           *(["--native"] if native else [])]
                spies[pid] = (role, subprocess.Popen(cmd_spy, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), raw)
                log.info("py-spy on %s (pid %d)", role, pid)
            for pid in spies:
                got = _cpu_s(pid)
                if got is not None:
                    cpu[pid] = got
            time.sleep(0.05)
        stdout = child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()
        for role, spy, raw in spies.values():
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                spy.terminate()
                spy.wait(timeout=10)
    reader.join(timeout=5)
    if child.returncode != 0:
        raise RuntimeError(f"the async workload exited {child.returncode}:\n{''.join(stderr)[-3000:]}")
    result = _last_json(stdout)
    rows = []
    by_role: dict[str, list] = collections.defaultdict(list)
    for role, spy, raw in spies.values():
        if raw.exists():
            by_role[role] += read_raw(raw)
        else:
            log.warning("py-spy wrote nothing for %s: %s", role, spy.stderr.read()[-500:] if spy.stderr else "")
    for role in ROLES:
        counts, total, startup, waiting = shares(by_role.get(role, []))
        rows.append({**result, "role": f"async {role}", "counts": counts, "samples": total, "startup_samples": startup,
                     "waiting_samples": waiting, "cpu_s": sum(cpu.get(pid, 0.0) for pid, (ro, _, _) in spies.items() if ro == role),
                     "raw": [str(r) for ro, _, r in spies.values() if ro == role]})
    return rows


# ---- report -------------------------------------------------------------------------------------------

def markdown(rows: list[dict], rate: int) -> str:
    cols = [f"{r['role']}, {r['backend']}" for r in rows]
    lines = ["| category | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    used = [c for c in CATEGORIES if any(r["counts"].get(c) for r in rows)]
    for cat in used:
        cells = [f"{r['counts'].get(cat, 0) / r['samples']:.1%}" if r["samples"] else "-" for r in rows]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    for g in ("ext.replay (all)", "learner torch (tensors, forward, backward, clip, Adam)", "rest"):
        cells = [f"**{group(r['counts']).get(g, 0) / r['samples']:.1%}**" if r["samples"] else "-" for r in rows]
        lines.append(f"| **{g}** | " + " | ".join(cells) + " |")
    lines.append("| busy samples counted | " + " | ".join(str(r["samples"]) for r in rows) + " |")
    lines.append("| samples waiting (left out) | " + " | ".join(str(r.get("waiting_samples", 0)) for r in rows) + " |")
    lines.append("| samples at start-up or with no frame (left out) | " + " | ".join(str(r["startup_samples"]) for r in rows) + " |")
    lines.append("| busy samples / rate (s) | " + " | ".join(f"{r['samples'] / rate:.1f}" for r in rows) + " |")
    lines.append("| process CPU s (all threads, whole life) | " + " | ".join(
        "-" if r.get("cpu_s") is None else f"{r['cpu_s']:.1f}" for r in rows) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env-steps", type=int, default=8_000)
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--native", action="store_true", help="py-spy --native: C frames too")
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--backends", nargs="+", default=["ext", "ref"], choices=["ext", "ref"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/env-learner-profile"))
    p.add_argument("--workload", choices=["sync", "async"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workload:
        logging.basicConfig(level=logging.WARNING)
        workload(args.workload, args.env_steps, args.seed)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from rich.console import Console

    console = Console(width=220)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"commit": commit_label(), "command": " ".join(["python", *sys.argv]), "rate": args.rate, "native": args.native,
            "loadavg_start": load_average()}
    console.print(f"commit {meta['commit']}, loadavg {meta['loadavg_start']}")
    rows: list[dict] = []
    for mode in args.modes:
        for backend in args.backends:
            load0 = load_average()
            got = ([profile_sync(backend, args.env_steps, args.seed, args.rate, args.native, args.out)] if mode == "sync"
                   else profile_async(backend, args.env_steps, args.seed, args.rate, args.native, args.out))
            for r in got:
                r["loadavg_before"], r["loadavg_after"] = load0, load_average()
                if r["backend"] != backend:
                    raise RuntimeError(f"asked for the {backend} backend, the workload ran {r['backend']}")
                g = group(r["counts"])
                console.print(
                    f"{r['role']:<28} {backend}: {r['env_steps']:,} env steps, {r['updates']:,} updates in {r['train_s']:.1f} s; "
                    f"{r['samples']} samples ({r['startup_samples']} start-up left out); ext.replay "
                    f"{g.get('ext.replay (all)', 0) / max(1, r['samples']):.1%}, learner torch "
                    f"{g.get('learner torch (tensors, forward, backward, clip, Adam)', 0) / max(1, r['samples']):.1%}  load {r['loadavg_after']}")
            rows += got
            (args.out / "profile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    meta["loadavg_end"] = load_average()
    md = markdown(rows, args.rate)
    (args.out / "profile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "table.md").write_text(md + "\n")
    console.print(md)
    console.print(f"loadavg at the end {meta['loadavg_end']}; raw profiles, JSON and table in {args.out}")


if __name__ == "__main__":
    main()
