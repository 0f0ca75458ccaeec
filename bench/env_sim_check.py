"""The env sim against the real pipeline on this machine: each plain configuration of a
``bench/env_throughput.py`` run (its rows.json) simulated on the costs ``bench/env_sim_costs.py``
measured, beside the env steps/s the real Ray runs got.

    python bench/env_sim_check.py runs/env-throughput/rows.json $(python bench/env_sim_costs.py | grep -v '^#')
    python bench/env_sim_check.py runs/env-throughput/rows.json --fit [--set ...]

Costs measured alone leave out what the pipeline adds to each part on a shared machine; ``--fit``
takes those from the two baselines and so tests the sim's structure on the other rows.

The sim is given one machine with the cores the real run had (its rows' ``meta``), the throughput
bench's scenario changes and the same env steps. What it leaves out, and so what a gap here measures: the driver,
Ray's own processes and the codec's cost growing with a chunk's rows. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.env_throughput import BASELINE, Config, scenario_changes  # noqa: E402
from core.model.config import with_changes  # noqa: E402
from core.model.env_config import EnvScenario  # noqa: E402
from core.runtimes.sim_env import run_env_sim  # noqa: E402


def simulated(c: Config, env_steps: int, seed: int, costs: dict, cores: int) -> dict:
    sc = with_changes(EnvScenario(), {
        **scenario_changes(c, env_steps), "runtime": "sim", "sim.machines": 1, "sim.cores_per_machine": cores,
        **costs,
    })
    curve = run_env_sim(sc, "async", seed)
    st = curve.replay
    return {"env_steps_per_s": st["env_steps"] / curve.train_s, "updates_per_s": curve.updates / curve.train_s,
            "insert_blocked_s": st.get("insert_blocked_s", 0.0), "sample_blocked_s": st.get("sample_blocked_s", 0.0)}


def fitted(real: dict[tuple, list[dict]], costs: dict) -> dict:
    """The costs as the pipeline paid them in the two baselines (``BASELINE``'s send_every and
    samplers): the sampler's compute and its insert's round trip from the sampler-bound one, the
    learner's update (its publishing included) from the learner-bound one; the rest from
    ``costs`` or the defaults. The other rows then test only the sim's structure."""
    default = EnvScenario()
    sim, envs = default.sim, default.env.envs_per_sampler
    get = lambda k: costs.get(f"sim.{k}", getattr(sim, k))  # noqa: E731
    sb, lb = real[("sampler-bound", *BASELINE)], real[("learner-bound", *BASELINE)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    vector_alone = envs * (get("env_step_s") + get("forward_env_s")) + get("forward_s")
    vector_real = mean([r["sampler_collect_s"] / (r["env_steps"] / envs) for r in sb])
    k = vector_real / vector_alone
    rows = envs * BASELINE[0]
    insert = mean([r["sampler_insert_s"] / r["chunks"] for r in sb])
    replay = get("replay_call_s") + rows * get("replay_insert_row_s")
    return {**costs, "sim.env_step_s": k * get("env_step_s"), "sim.forward_s": k * get("forward_s"),
            "sim.forward_env_s": k * get("forward_env_s"), "sim.rpc_latency_s": max(0.0, insert - replay),
            "sim.learner_update_s": mean([r["learner_update_s"] / r["updates"] for r in lb])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", type=Path, help="rows.json of a bench/env_throughput.py run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="sim.KEY=VALUE")
    p.add_argument("--fit", action="store_true",
                   help="take the compute, round-trip and update costs from the baseline rows (see fitted())")
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
    if args.fit:
        costs = fitted(real, costs)
    print(f"# real: {args.rows} (commit {data['meta']['commit']}); sim costs: " + ", ".join(f"{k}={v:.3g}" for k, v in costs.items()))
    print("| regime | send_every | samplers | real env steps/s | sim env steps/s | sim / real | real upd/s | sim upd/s |")
    print("|---|---|---|---|---|---|---|---|")
    for (regime, send_every, samplers), rs in sorted(real.items()):
        c = Config(regime, send_every, samplers)
        env_steps = rs[0]["env_steps"]
        sim = simulated(c, env_steps, 0, costs, data["meta"]["cpus"])
        got = sum(r["env_steps_per_s"] for r in rs) / len(rs)
        upd = sum(r["updates_per_s"] for r in rs) / len(rs)
        print(f"| {regime} | {send_every} | {samplers} | {got:,.0f} | {sim['env_steps_per_s']:,.0f} | "
              f"{sim['env_steps_per_s'] / got:.2f} | {upd:,.1f} | {sim['updates_per_s']:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
