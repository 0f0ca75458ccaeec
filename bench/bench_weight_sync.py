"""Weight sync: collective broadcast against the object store, measured on this machine.

``python bench/bench_weight_sync.py rate``: gloo broadcast from a source process to 2
receiver processes (loopback TCP), a synthetic model of ``--mb`` MiB in the wire dtype, for
several bucket sizes: seconds per sync and GB/s (bytes a receiver gets / time).

``python bench/bench_weight_sync.py run [--set k=v ...]``: scenarios/real-cpu-vllm.yaml (one
mode) with ``sync.transport`` broadcast and object_store alternating in this one process:
per-sync pause / drain / transfer times, bytes per sync, and each actor's peak RSS (VmHWM)
and /dev/shm's peak use, sampled every 20 ms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _receiver(name: str, members: list, host: str, port: int, syncs: list, mb: int, dtype: str, q) -> None:
    import torch

    from core.real.weight_broadcast import BroadcastTicket, GroupMember, RollCall, manifest_of

    torch.set_num_threads(1)
    params = _model(mb, dtype)
    roll = RollCall(name, 120)
    member = None
    for seq, bucket in syncs:
        ticket = BroadcastTicket(host, port, seq, seq, bucket, 120, tuple(members))
        m, join = roll.answer(ticket)
        if join:
            member = GroupMember(m, manifest_of(params.items()), timeout_s=120, who=name)
        with torch.no_grad():
            member.receive(bucket, lambda vs: [params[n].copy_(v) for n, v in vs])
    q.put(name)


def _model(mb: int, dtype: str) -> dict:
    """Square layers of 4 MiB in fp32 plus one embedding of 1/8 of the model, like an LLM's."""
    import torch

    dt = getattr(torch, dtype)
    n = mb * 2**20 // 4
    emb = n // 8
    out = {"embed": torch.zeros(emb // 1024, 1024, dtype=dt)}
    left, i = n - emb, 0
    while left >= 1024 * 1024:
        out[f"layer{i}.w"] = torch.zeros(1024, 1024, dtype=dt)
        left -= 1024 * 1024
        i += 1
    return out


def rate(args) -> dict:
    import torch

    from core.real.weight_broadcast import BroadcastSource, manifest_of

    torch.set_num_threads(1)
    src = _model(args.mb, "float32")
    for t in src.values():
        t.normal_()
    buckets = [int(b * 2**20) for b in args.buckets]
    repeats = args.repeats
    out = {}
    for dtype in args.dtypes:
        source = BroadcastSource("127.0.0.1", bucket_bytes=buckets[0], timeout_s=120)
        plan = [(1 + i, b) for i, b in enumerate(x for x in buckets for _ in range(repeats + 1))]
        members = ["r0", "r1"]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_receiver, args=(m, members, "127.0.0.1", source.port, plan, args.mb, dtype, q)) for m in members]
        for p in procs:
            p.start()
        manifest = manifest_of(src.items(), dtype)
        rows = {}
        for seq, bucket in plan:
            source.bucket_bytes = bucket
            ticket = source.ticket(seq).addressed(members, regroup=False)
            t0 = time.perf_counter()
            st = source.send(ticket, lambda: src, manifest, threading.Event())
            dt = time.perf_counter() - t0
            rows.setdefault(bucket, []).append((dt, st.broadcast_s, st.bytes, st.buckets, st.buffer_bytes[0]))
        for p in procs:
            p.join(60)
        source.close()
        for bucket, r in rows.items():
            r = r[1:]  # the first sync of each bucket size joins the group / warms up
            s = statistics.median(x[1] for x in r)
            out[f"{dtype}/bucket_{bucket // 2**20}MiB"] = {
                "bytes": r[0][2], "buckets": r[0][3], "staging_bytes": r[0][4],
                "broadcast_s_median": round(s, 4), "gb_s": round(r[0][2] / s / 1e9, 3),
                "broadcast_s_all": [round(x[1], 4) for x in r],
            }
    return out


def _rss_sampler(pids: dict, stop: threading.Event, peaks: dict) -> None:
    while not stop.is_set():
        for name, pid in list(pids.items()):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peaks[name] = max(peaks.get(name, 0), int(line.split()[1]) * 1024)
            except OSError:
                pass
        if os.path.isdir("/dev/shm"):
            used = shutil.disk_usage("/dev/shm").used
            peaks["/dev/shm"] = max(peaks.get("/dev/shm", 0), used)
        stop.wait(0.02)


def run(args) -> dict:
    from core.model.config import with_changes
    from harness.scenario import load
    from core.real.workers import apply_env
    from core.runtimes.dispatch import run_mode
    from core.runtimes.ray_start import cluster

    apply_env()
    sc = load("scenarios/real-cpu-vllm.yaml")
    changes = {"eval.every": 0, "trainer.steps": args.steps, "modes": [args.mode]}
    for kv in args.set:
        k, v = kv.split("=", 1)
        changes[k] = json.loads(v) if v[:1] in "[{0123456789-tf" and v not in ("true", "false") else v
    sc = with_changes(sc, changes)
    out = {t: [] for t in ("broadcast", "object_store")}
    with cluster(None, sc.ray.num_cpus):
        for _ in range(args.rounds):
            for transport in ("broadcast", "object_store"):
                s = with_changes(sc, {"sync.transport": transport})
                pids, peaks, stop = {}, {}, threading.Event()
                base_shm = shutil.disk_usage("/dev/shm").used if os.path.isdir("/dev/shm") else 0
                sampler = threading.Thread(target=_rss_sampler, args=(pids, stop, peaks))
                sampler.start()
                t0 = time.perf_counter()
                try:
                    r = run_mode(s, args.mode, on_processes=lambda rows: pids.update(dict(rows)))
                finally:
                    stop.set()
                    sampler.join()
                sy = r.sync
                out[transport].append({
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "pause_s": [round(x, 4) for x in sy.pause_s],
                    "drain_s": [round(x, 4) for x in sy.drain_s],
                    "transfer_s": [round(x, 4) for x in sy.transfer_s],
                    "peak_rss_mb": {k: round(v / 2**20, 1) for k, v in peaks.items() if k != "/dev/shm"},
                    "dev_shm_peak_extra_mb": round((peaks.get("/dev/shm", base_shm) - base_shm) / 2**20, 1),
                })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("rate")
    a.add_argument("--mb", type=int, default=256, help="model size in MiB of fp32")
    a.add_argument("--buckets", type=float, nargs="+", default=[4, 16, 64])
    a.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    a.add_argument("--repeats", type=int, default=3)
    b = sub.add_parser("run")
    b.add_argument("--mode", default="async")
    b.add_argument("--steps", type=int, default=6)
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    print(json.dumps(rate(args) if args.what == "rate" else run(args), indent=1))


if __name__ == "__main__":
    main()
