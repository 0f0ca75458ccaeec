"""The simulator against every published system-level table in scenarios/published/: each
scenario was written from its publication's configuration with the project's defaults where the
publication is silent, and nothing was fitted to the figure it is compared with.

    python -m bench.published_tables [--no-band] [--out FILE.json] [FILE.yaml ...]

For each variant: the predicted speedup over sync (trained samples per second: a published step
time is at a fixed batch), with ``--band`` the 10th-90th percentile over the scenario's
uncertain inputs, the published speedup, how far off, and whether it lies in the band; for a
weight-sync table (variants whose published figure is ``sync_s``), the modelled seconds of one
sync and the speedup of bucketing. Prints a markdown table; ``--out`` keeps every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from core.model.config import with_changes
from core.runtimes.dispatch import run_mode
from core.sim import band as core_band
from core.sim.costs import TransferCost
from harness import band
from harness.scenario import load_variants

TABLES = (
    "scenarios/published/verl-7b-fully-async.yaml",
    "scenarios/published/verl-30b-a3b-fully-async.yaml",
    "scenarios/published/verl-7b-retool.yaml",
    "scenarios/published/verl-7b-one-step-off.yaml",
    "scenarios/published/nemo-rl-one-step-off.yaml",
    "scenarios/areal.yaml",
    "scenarios/published/verl-weight-sync.yaml",
)
WITHIN = 0.25  # the issue's bar: a speedup within 25 % of the published one


def speedup_row(label: str, sc, pub: dict, with_band: bool) -> dict:
    """One variant run in sync and the published mode, its band, and the comparison."""
    mode = pub.get("mode", "partial")
    sc = with_changes(sc, {"modes": ["sync", mode]})
    runs = {m: run_mode(sc, m) for m in ("sync", mode)}
    rate = {m: r.ledger.trainings / r.end_s for m, r in runs.items()}
    step = {m: sc.trainer.batch_size * sc.trainer.sync_every / rate[m] for m in runs}  # seconds a version
    pred = rate[mode] / rate["sync"]
    row = {"variant": label, "mode": mode, "predicted": pred, "published": pub["speedup_vs_sync"],
           "off": pred / pub["speedup_vs_sync"] - 1, "source": pub.get("source", ""),
           "version_s": step, "trainer_busy": {m: r.trainer.compute_s / r.end_s for m, r in runs.items()}}
    if with_band:
        drawn = band.compute(sc)
        b = drawn["modes"][mode]["samples"]
        row["band"] = [b.get("p10"), b.get("p50"), b.get("p90")]
        row["inside"] = b.get("p10") is not None and b["p10"] <= pub["speedup_vs_sync"] <= b["p90"]
        row["measure_first"] = b.get("measure_first")
        row["band_failed"] = drawn["failed"]
    return row


def sync_row(label: str, sc, pub: dict, with_band: bool) -> dict:
    """One weight sync's modelled seconds, with ``with_band`` over the band's draws of its inputs
    (no run: the sync's cost is a formula)."""
    t = TransferCost(sc, colocated=False)
    row = {"variant": label, "predicted_s": t.seconds(), "published_s": pub["sync_s"], "off": t.seconds() / pub["sync_s"] - 1,
           "tensors": t.tensors, "source": pub.get("source", "")}
    if with_band:
        ks, values = core_band.draws(sc)
        drawn = np.array([TransferCost(with_changes(sc, core_band.changes(sc, ks, row_)), colocated=False).seconds() for row_ in values])
        b = core_band.summarize(ks, values, drawn)
        row["band"] = [b["p10"], b["p50"], b["p90"]]
        row["inside"] = b["p10"] <= pub["sync_s"] <= b["p90"]
        row["measure_first"] = b.get("measure_first")
        row["draws"] = drawn.tolist()
    return row


def table(path: str, with_band: bool) -> dict:
    variants = load_variants(path)
    rows = []
    for v in variants:
        pub = v.published
        if "sync_s" in pub:
            rows.append(sync_row(v.label, v.scenario, pub, with_band))
        elif "speedup_vs_sync" in pub:
            rows.append(speedup_row(v.label, v.scenario, pub, with_band))
    return {"file": path, "rows": rows}


def bucketing(rows: list[dict]) -> list[dict]:
    """Pairs of weight-sync rows (``X-per-tensor``, ``X-bucketed``) as a speedup of bucketing."""
    by = {r["variant"]: r for r in rows}
    out = []
    for name, r in by.items():
        if name.endswith("-per-tensor") and (b := by.get(name.replace("-per-tensor", "-bucketed"))):
            pred, pub = r["predicted_s"] / b["predicted_s"], r["published_s"] / b["published_s"]
            pair = {"variant": name.replace("-per-tensor", ": bucketed vs per tensor"), "mode": "-", "predicted": pred, "published": pub,
                    "off": pred / pub - 1}
            if "draws" in r and "draws" in b:  # the same draws on both sides: one band of the ratio
                ratio = np.asarray(r["draws"]) / np.asarray(b["draws"])
                lo, mid, hi = (float(np.percentile(ratio, q)) for q in core_band.PERCENTILES)
                pair.update(band=[lo, mid, hi], inside=lo <= pub <= hi)
            out.append(pair)
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| table | variant | mode | predicted | band p10-p90 | published | off by | inside | measure first |",
             "|---|---|---|---|---|---|---|---|---|"]
    sync_lines = ["| variant | tensors | predicted s | band p10-p90 | published s | off by | inside | measure first |",
                  "|---|---|---|---|---|---|---|---|"]
    for t in results:
        name = Path(t["file"]).stem
        for r in t["rows"]:
            b = r.get("band")
            inside = ("yes" if r["inside"] else "no") if "inside" in r else "-"
            if "predicted_s" in r:
                shown = f"{b[0]:.3g} - {b[2]:.3g}" if b else "-"
                sync_lines.append(f"| {r['variant']} | {r['tensors']:,} | {r['predicted_s']:.3g} | {shown} | {r['published_s']:.3g} | "
                                  f"{r['off']:+.0%} | {inside} | {r.get('measure_first') or '-'} |")
                continue
            shown = f"{b[0]:.2f}x - {b[2]:.2f}x" if b and b[0] is not None else "-"
            lines.append(f"| {name} | {r['variant']} | {r['mode']} | {r['predicted']:.2f}x | {shown} | {r['published']:.2f}x | "
                         f"{r['off']:+.0%} | {inside} | {r.get('measure_first') or '-'} |")
        for r in bucketing(t["rows"]):
            b = r.get("band")
            shown = f"{b[0]:.2f}x - {b[2]:.2f}x" if b else "-"
            inside = ("yes" if r["inside"] else "no") if "inside" in r else "-"
            lines.append(f"| {name} | {r['variant']} | - | {r['predicted']:.2f}x | {shown} | {r['published']:.2f}x | {r['off']:+.0%} | {inside} | - |")
    return "\n".join(lines) + "\n\nWeight syncs:\n\n" + "\n".join(sync_lines) + "\n"


def tally(results: list[dict]) -> str:
    rows = [r for t in results for r in t["rows"] if "predicted" in r] + [r for t in results for r in bucketing(t["rows"])]
    within = sum(abs(r["off"]) <= WITHIN for r in rows)
    banded = [r for r in rows if "inside" in r]
    inside = sum(r["inside"] for r in banded)
    return (f"{within} of {len(rows)} speedups within {WITHIN:.0%} of the published one; "
            f"{inside} of {len(banded)} published speedups inside the band")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.published_tables", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="scenario files (default: every table)")
    p.add_argument("--no-band", action="store_true", help="point predictions only")
    p.add_argument("--out", type=Path, help="write every figure here as JSON")
    args = p.parse_args(argv)
    results = [table(f, not args.no_band) for f in (args.files or TABLES)]
    sys.stdout.write(markdown(results) + "\n" + tally(results) + "\n")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
