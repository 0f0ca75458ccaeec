"""``python -m harness.run SCENARIO --band``: each mode's speedup over sync as an interval, and the
input that moves it most (core/sim/band.py says how the points are drawn). The speedup is in
trained tokens per second, as the comparison table's; in trained samples too (``samples``), the
unit of a published step time at a fixed batch.

The band runs ``band.points`` scenarios besides the run itself, each in every mode, in worker
processes; it is written into ``summary.json`` (``band``, and each mode's ``speedup_band``) and each
mode's ``report.json`` (``band``), and drawn in ``summary.png``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from core.model.config import ConfigError, Scenario, with_changes
from core.runtimes.dispatch import run_mode
from core.sim import band
from harness import report
from harness.process_pool import run_all
from harness.scenario import ScenarioError


def check(sc: Scenario) -> None:
    """Refuse, before anything runs, a scenario the band cannot be drawn for."""
    if sc.runtime != "sim":
        raise ScenarioError(f"--band: runtime {sc.runtime} measures, it does not predict; fix: drop --band, or run the "
                            "scenario on the sim (harness.calibrate turns a real run into one)")
    if "sync" not in sc.modes or len(sc.modes) < 2:
        raise ScenarioError(f"--band: modes = {list(sc.modes)}; the band is of each mode's speedup over sync; "
                            "fix: list sync and at least one other mode")
    if len(sc.run_seeds) > 1:
        raise ScenarioError(f"--band: seeds = {list(sc.seeds)}; fix: draw the band for one seed (--set seeds=[])")


def rates(sc: Scenario, changes: dict) -> dict:
    """One point, in a worker process: trained (tokens, samples) per second of every mode of ``sc`` with
    ``changes`` (a point the scenario's checks refuse is a failed point, not the end of the band)."""
    try:
        point = with_changes(sc, changes)
    except ConfigError as exc:
        return {"error": str(exc)}
    out = {}
    for mode in sc.modes:
        r = run_mode(point, mode)
        end = r.end_s if r.end_s > 0 else float("inf")
        out[mode] = ((r.ledger.prompt_tokens + r.ledger.response_tokens) / end, r.ledger.trainings / end)
    return out


def compute(sc: Scenario, workers: Optional[int] = None, on_done: Optional[Callable] = None) -> dict:
    """The band of every mode but sync: its points' percentiles and what to measure first."""
    ks, values = band.draws(sc)
    jobs = [(i, (sc, band.changes(sc, ks, values[i]))) for i in range(len(values))]
    results = run_all(rates, jobs, workers or os.cpu_count() or 1, on_done)
    failed = [results[i]["error"] for i in range(len(values)) if "error" in results[i]]
    def speedups(mode: str, k: int) -> np.ndarray:  # k: 0 trained tokens, 1 trained samples
        return np.array([results[i][mode][k] / results[i]["sync"][k] if "error" not in results[i] and results[i]["sync"][k] else np.nan
                         for i in range(len(values))])

    modes = {mode: {**band.summarize(ks, values, speedups(mode, 0)), "samples": band.summarize(ks, values, speedups(mode, 1))}
             for mode in sc.modes if mode != "sync"}
    return {
        "points": len(values),
        "failed": len(failed),
        **({"first_failure": failed[0]} if failed else {}),
        "percentiles": list(band.PERCENTILES),
        "inputs": [{"key": k.key, "low": k.low, "high": k.high, "why": k.why} for k in ks],
        "modes": modes,
    }


def attach(drawn: dict, summary: dict, where: Path) -> None:
    """Write the band into the run's summary and each mode's report.json."""
    summary["band"] = drawn
    for mode, b in drawn["modes"].items():
        if mode in summary["modes"] and "p10" in b:
            summary["modes"][mode]["speedup_band"] = [b["p10"], b["p50"], b["p90"]]
            s = b["samples"]
            summary["modes"][mode]["speedup_band_samples"] = [s["p10"], s["p50"], s["p90"]]
        path = where / mode / "report.json"
        if path.is_file():
            rep = report.read_json(path)
            rep["band"] = b
            report.write_json(path, rep)


def lines(summary: dict) -> list[str]:
    """The band under the comparison table: one line per mode."""
    drawn = summary.get("band")
    if not drawn:
        return []
    out = [f"band: {drawn['points']} draws of {len(drawn['inputs'])} uncertain inputs (Latin hypercube; "
           f"{drawn['failed']} failed); speedup over sync, 10th-90th percentile:"]
    for mode, b in drawn["modes"].items():
        point = summary["modes"].get(mode, {}).get("speedup_vs_sync_tokens")
        if "p10" not in b:
            out.append(f"  {mode}: no point ran")
            continue
        first = (f"; measure first: {b['measure_first']} (rank correlation {b['measure_first_rank_corr']:+.2f})"
                 if "measure_first" in b else "")
        shown = f"{point:.2f}x " if point else ""
        out.append(f"  {mode}: {shown}[{b['p10']:.2f}x - {b['p90']:.2f}x]{first}")
    return out
