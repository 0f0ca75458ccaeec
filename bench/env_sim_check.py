"""The env sim against the real pipeline on this machine: each plain configuration of a
``bench/env_throughput.py`` run (its rows.json) simulated on the costs ``bench/env_sim_costs.py``
measured, beside the env steps/s the real Ray runs got.

    python bench/env_sim_check.py runs/env-throughput/rows.json $(python bench/env_sim_costs.py | grep -v '^#')

The sim is given one machine with ``os.cpu_count()`` cores, the throughput bench's scenario
changes and the same env steps. What it leaves out, and so what a gap here measures: the driver,
Ray's own processes and the codec's cost growing with a chunk's rows. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.env_throughput import Config, scenario_changes  # noqa: E402
from core.model.config import with_changes  # noqa: E402
from core.model.env_config import EnvScenario  # noqa: E402
from core.runtimes.sim_env import run_env_sim  # noqa: E402


def simulated(c: Config, env_steps: int, seed: int, costs: dict) -> dict:
    sc = with_changes(EnvScenario(), {
        **scenario_changes(c, env_steps), "runtime": "sim", "sim.machines": 1, "sim.cores_per_machine": os.cpu_count(),
        **costs,
    })
    curve = run_env_sim(sc, "async", seed)
    st = curve.replay
    return {"env_steps_per_s": st["env_steps"] / curve.train_s, "updates_per_s": curve.updates / curve.train_s,
            "insert_blocked_s": st.get("insert_blocked_s", 0.0), "sample_blocked_s": st.get("sample_blocked_s", 0.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", type=Path, help="rows.json of a bench/env_throughput.py run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="sim.KEY=VALUE")
    args = p.parse_args(argv)
    costs = {}
    for item in args.overrides:
        key, _, raw = item.partition("=")
        try:
            costs[key] = float(raw)
        except ValueError:
            p.error(f"--set {item}: expected sim.KEY=NUMBER")
        if not key.startswith("sim."):
            p.error(f"--set {item}: only sim.* costs are taken here")
    data = json.loads(args.rows.read_text())
    real: dict[tuple, list[dict]] = {}
    for r in data["rows"]:
        if not r.get("variant"):
            real.setdefault((r["regime"], r["send_every"], r["samplers"]), []).append(r)
    print(f"# real: {args.rows} (commit {data['meta']['commit']}); sim costs: {costs}")
    print("| regime | send_every | samplers | real env steps/s | sim env steps/s | sim / real | real upd/s | sim upd/s |")
    print("|---|---|---|---|---|---|---|---|")
    for (regime, send_every, samplers), rs in sorted(real.items()):
        c = Config(regime, send_every, samplers)
        env_steps = rs[0]["env_steps"]
        sim = simulated(c, env_steps, 0, costs)
        got = sum(r["env_steps_per_s"] for r in rs) / len(rs)
        upd = sum(r["updates_per_s"] for r in rs) / len(rs)
        print(f"| {regime} | {send_every} | {samplers} | {got:,.0f} | {sim['env_steps_per_s']:,.0f} | "
              f"{sim['env_steps_per_s'] / got:.2f} | {upd:,.1f} | {sim['updates_per_s']:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
