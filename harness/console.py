"""The terminal: a progress display while modes run and the comparison table after."""

from __future__ import annotations

import time

from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from core.model import progress


class ModeProgress:
    """Shows the running mode, simulated time and trained samples; redraws at most 10 times a second."""

    def __init__(self, console: Console, total_steps: int) -> None:
        self.console = console
        self.total = total_steps
        self._progress = Progress(
            TextColumn("[bold]{task.fields[mode]:>14}"),
            BarColumn(),
            TextColumn("step {task.completed:>6.0f}/{task.total:.0f}"),
            TextColumn("sim {task.fields[sim]:>10}"),
            TextColumn("{task.fields[samples]:>10} samples"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self._task = None
        self._last = 0.0

    def __enter__(self) -> "ModeProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def start(self, mode: str) -> None:
        self._task = self._progress.add_task(mode, total=self.total, mode=mode, sim="0 s", samples=0)
        self._last = 0.0

    def advance(self) -> None:
        """One more of ``total_steps`` done (a band's draw)."""
        self._progress.advance(self._task)

    def on_step(self, event: progress.Progress) -> None:
        if not isinstance(event, progress.StepTrained):
            return
        now = time.monotonic()
        if event.step < self.total and now - self._last < 0.1:
            return
        self._last = now
        self._progress.update(self._task, completed=event.step, sim=_duration(event.at_s), samples=f"{event.trainings:,}")


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def comparison_table(name: str, summary: dict) -> Table:
    """One row per mode, narrow enough for an 80-column terminal."""
    modes = summary["modes"]
    lost = sum(row["samples/lost"] for row in modes.values())
    seeds = summary.get("seeds")
    which = f"mean over seeds {', '.join(map(str, seeds))}" if seeds else "one seed"
    moved = sorted({row["sync/bytes_mean"] for row in modes.values() if row.get("sync/bytes_mean")})
    # What one sync moved (the adapter alone with trainer.lora): real runs count it, the sim prices it.
    synced = f" Moved per sync: {' / '.join(_compact(b) + 'B' for b in moved)}." if moved else ""
    t = Table(
        title=f"{name}: one workload, {which}, every mode",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        caption=(
            "Trained samples and tokens (prompt + response) per second; vs sync and of bound in tokens. "
            "GPU time: % of all GPU-seconds generating/training/syncing/idle. "
            f"Pause: mean sync pause. Stale: mean/max versions. Samples lost: {lost}.{synced}"
        ),
        caption_justify="left",
    )
    # A real run has no analytic bound; it shows what it learned instead.
    learned = any("learn/reward_first_steps" in row for row in modes.values())
    third = "reward" if learned else "of bound"
    for title in ("mode", "samples/s", "tokens/s", "vs sync", third, "GPU time", "pause", "stale"):
        t.add_column(title, justify="left" if title == "mode" else "right", no_wrap=True)
    for mode, row in modes.items():
        if learned:
            third_cell = f"{row['learn/reward_first_steps']:.2f}->{row['learn/reward_last_steps']:.2f}"
        else:
            third_cell = _fmt("bound/efficiency", row.get("bound/efficiency"))
        t.add_row(
            mode,
            _fmt("throughput/trained_samples_per_s", row["throughput/trained_samples_per_s"]),
            _compact(row["throughput/trained_tokens_per_s"]),
            _fmt("speedup_vs_sync", row.get("speedup_vs_sync_tokens", row.get("speedup_vs_sync"))),
            third_cell,
            "/".join(f"{100 * row[f'gpu_time/{k}']:.0f}" for k in ("generate", "train", "sync", "idle")),
            _fmt("sync/pause_mean_s", row["sync/pause_mean_s"]),
            f"{row['staleness/mean']:.2f}/{row['staleness/max']}",
        )
    return t


def target_table(name: str, summary: dict) -> Table | None:
    """Time to the target reward per mode, against sync, and the final reward; over several
    seeds as mean ± standard deviation. None when no mode reports rewards (the sim)."""
    modes = summary["modes"]
    if not any("learn/reached_target" in row for row in modes.values()):
        return None
    over = summary.get("over_seeds")
    target = next(row["learn/target_reward"] for row in modes.values() if "learn/target_reward" in row)
    t = Table(
        title=f"{name}: time to reward {target:g}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
        caption=(
            "Time and trained samples until the trailing mean batch reward first reaches the target; "
            "vs sync: how many times sooner than sync; final reward: mean batch reward of the last "
            "learn.reward_window steps; 2nd half: of the responses policy versions steps/2 .. steps-1-max_staleness "
            "sampled (the same versions, trained on the same samples, in every mode); "
            "drift: KL(behaviour || trained policy) per token; length swing: std / mean of the step's response "
            "length over the second half"
            + ("; mean ± std over the seeds that reached it" if over else "") + "."
        ),
        caption_justify="left",
    )
    for col in ("mode", "reached", "time to target", "samples", "vs sync", "final reward", "2nd half", "drift", "length swing"):
        t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
    for mode, row in modes.items():
        if "learn/reached_target" not in row:
            t.add_row(mode, *["-"] * 8)
            continue
        if over:
            o = over[mode]
            n = len(o["learn/reached_target"]["per_seed"])
            cells = [
                f"{o['learn/time_to_target_s']['n']}/{n} seeds",
                _spread("learn/time_to_target_s", o["learn/time_to_target_s"]),
                _spread("learn/samples_to_target", o["learn/samples_to_target"]),
                _spread("speedup_vs_sync", o.get("speedup_to_target_vs_sync")),
                _spread("learn/final_reward", o["learn/final_reward"]),
                _spread("learn/final_reward", o.get("learn/version_reward_second_half")),
                _spread("learn/behaviour_kl", o.get("learn/behaviour_kl")),
                _spread("learn/length_swing", o.get("learn/length_swing")),
            ]
        else:
            reached = bool(row["learn/reached_target"])
            cells = [
                "yes" if reached else "no",
                _fmt("learn/time_to_target_s", row["learn/time_to_target_s"]) if reached else "not reached",
                _fmt("learn/samples_to_target", row["learn/samples_to_target"]),
                _fmt("speedup_vs_sync", row.get("speedup_to_target_vs_sync")),
                _fmt("learn/final_reward", row["learn/final_reward"]),
                _fmt("learn/final_reward", row.get("learn/version_reward_second_half")),
                _fmt("learn/behaviour_kl", row.get("learn/behaviour_kl")),
                _fmt("learn/length_swing", row.get("learn/length_swing")),
            ]
        t.add_row(mode, *cells)
    return t


def seeds_table(name: str, summary: dict) -> Table | None:
    """Throughput per mode over several seeds: mean ± standard deviation, and min..max. None
    for a run of one seed."""
    over = summary.get("over_seeds")
    if not over:
        return None
    t = Table(
        title=f"{name}: over seeds {', '.join(map(str, summary['seeds']))}", title_justify="left",
        box=box.SIMPLE_HEAD, pad_edge=False,
        caption="mean ± sample std, then min..max, over seeds; vs sync: each seed against its own sync, in samples/s.",
        caption_justify="left",
    )
    shown = (("throughput/trained_samples_per_s", "samples/s"), ("throughput/trained_tokens_per_s", "tokens/s"),
             ("speedup_vs_sync", "vs sync"))
    t.add_column("mode", no_wrap=True)
    for _, title in shown:
        t.add_column(title, justify="right", no_wrap=True)
    for mode, o in over.items():
        t.add_row(mode, *[_spread(k, o.get(k), bounds=True) for k, _ in shown])
    return t


def _spread(key: str, s: dict | None, bounds: bool = False) -> str:
    if s is None or s["mean"] is None:
        return "-"
    fmt = _compact if key == "throughput/trained_tokens_per_s" else (lambda v: _fmt(key, v))
    text = f"{fmt(s['mean'])} ± {fmt(s['std'])}"
    if bounds:
        text += f" ({fmt(s['min'])}..{fmt(s['max'])})"
    return text


def _compact(v: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.1f}{suffix}"
    return f"{v:.1f}"


# Below these a mode's speed is partly the work it threw away or never finished.
LENGTH_BIAS_WARN = 0.97
WASTE_WARN = 0.02


def honesty_lines(summary: dict) -> list[str]:
    """A sentence per mode whose trained set is shorter than what it admitted, or which threw
    generated tokens away: samples/s then overstates its speed."""
    out = []
    for mode, row in summary["modes"].items():
        bias, waste = row.get("samples/length_bias"), row.get("tokens/wasted_share") or 0.0
        if (bias is None or bias >= LENGTH_BIAS_WARN) and waste <= WASTE_WARN:
            continue
        parts = []
        if bias is not None and bias < LENGTH_BIAS_WARN:
            parts.append(f"its trained responses are {100 * (1 - bias):.0f} % shorter than the ones it admitted")
        filtered = row.get("samples/filtered") or 0
        if waste > WASTE_WARN:
            of = f", {filtered:,} of them by the filter" if filtered else ""
            parts.append(
                f"{100 * waste:.0f} % of the tokens it generated were thrown away "
                f"({row.get('samples/dropped', 0):,} samples dropped{of})"
            )
        if bias is not None and bias < LENGTH_BIAS_WARN:
            tail = "its samples/s overstates its speed and its gradient favours short answers; read tokens/s"
        elif filtered:
            tail = "what the filter dropped had no learning signal, the GPU time that generated it is the filter's price"
        else:
            tail = "the GPU time that generated them bought nothing"
        out.append(f"{mode}: {' and '.join(parts)}: {tail}.")
    return out


def correction_lines(sc) -> list[str]:
    """One warning when a real run trains stale samples with no importance correction
    (``learn.correction: bypass``): PPO's clip, taken against the behaviour policy, is then all
    that bounds a step on samples from older weights, and users report collapse without a
    correction. The sim trains no loss: nothing to say there."""
    if sc.runtime == "sim" or sc.learn.correction != "bypass" or sc.staleness.max_staleness == 0:
        return []
    stale = [m for m in sc.modes if m != "sync"]
    if not stale:
        return []
    return [
        f"warning: {', '.join(stale)} train samples up to {sc.staleness.max_staleness} version(s) old with "
        "learn.correction: bypass, no importance weight: PPO's clip alone bounds their step; fix: pick a "
        "correction (decoupled, icepop, seq_tis, seq_mis, tis, m2po; docs/real-runtimes.md)"
    ]


def agent_lines(summary: dict) -> list[str]:
    """For agent episodes: per mode, the share of GPU time that engines stood idle while a tool
    ran for one of their episodes, and what the episodes were (turns, calls, seconds a call,
    errors, the trained response tokens that tools wrote and the loss masks out)."""
    rows = {mode: row for mode, row in summary["modes"].items() if "agent/episodes" in row}
    if not rows:
        return []
    idle = ", ".join(f"{mode} {100 * row['gpu_time/waiting_on_tools']:.1f} %" for mode, row in rows.items())
    out = [f"GPU time idle while waiting on tools: {idle}."]
    said: dict[str, list[str]] = {}
    for mode, row in rows.items():
        calls = row["agent/tool_calls"]
        per_call = row["agent/tool_s"] / calls if calls else 0.0
        masked = row["tokens/masked_observation"] / row["tokens/trained_response"] if row["tokens/trained_response"] else 0.0
        said.setdefault(f"{row['agent/turns_per_episode']:.1f} turns an episode, {calls:,.0f} tool calls of {per_call:.2f} s on average, "
                        f"{row['agent/tool_errors']:,.0f} errors; {100 * masked:.0f} % of trained response tokens are tool answers "
                        "(masked out of the loss).", []).append(mode)
    for line, modes in said.items():
        who = "Every mode" if len(modes) == len(rows) else ", ".join(modes)
        out.append(f"{who}: {line}")
    real = [(mode, row) for mode, row in rows.items() if "agent/reward_positive_first" in row]
    if real:  # the trainer saw the rewards: how many responses earned any (on arithmetic, a right call)
        share = ", ".join(f"{mode} {100 * row['agent/reward_positive_first']:.0f} -> {100 * row['agent/reward_positive_last']:.0f} %"
                          for mode, row in real)
        out.append(f"Responses that earned a reward, first to last steps: {share}.")
        made = ", ".join(f"{mode} {row.get('agent/tool_calls_executed', 0):,.0f} made, {row.get('agent/tool_calls_replayed', 0):,.0f} from the record"
                         for mode, row in real)
        out.append(f"Tool calls executed, and asked again and answered from the record (after a sync or restart): {made}.")
    return out


# Outside these an implied MFU says the scenario's costs (or a published time) are not physical:
# above peak, or a trainer idling at its own work.
MFU_HIGH = 1.0
MFU_LOW = 0.05


def implied_mfu_lines(summary: dict) -> list[str]:
    """A sentence per mode and role whose implied MFU is above 100 % or below 5 %. The engines
    are flagged above 100 % only: decode reads every weight per step, and a few % is its norm."""
    out = []
    for mode, row in summary["modes"].items():
        for key, role in (("util/implied_trainer_mfu", "trainer"), ("util/implied_rollout_mfu", "engines")):
            v = row.get(key)
            if v is None or MFU_LOW <= v <= MFU_HIGH or (role == "engines" and v < MFU_LOW):
                continue
            why = "above the GPUs' peak" if v > MFU_HIGH else "below 5 % of peak while busy"
            out.append(f"{mode}: the {role} imply {100 * v:.1f} % MFU ({key}), {why}: check the scenario's costs.")
    return out


def faults_table(name: str, summary: dict) -> Table | None:
    """Every injected fault of every mode and how long its component took to serve again;
    None when the run injected none."""
    modes = summary["modes"]
    if not any(row.get("faults") for row in modes.values()):
        return None
    t = Table(
        title=f"{name}: faults and recoveries", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
        caption="recovered after: until the component served again (a slowdown: until it ended).",
        caption_justify="left",
    )
    for col in ("mode", "fault", "at", "recovered after", "requeued", "lost"):
        t.add_column(col, justify="left" if col in ("mode", "fault") else "right", no_wrap=True)
    for mode, row in modes.items():
        for i, f in enumerate(row.get("faults") or []):
            after = "-" if f["recovered_s"] is None else _duration(f["recovered_s"] - f["at_s"])
            last = i == len(row["faults"]) - 1
            t.add_row(
                mode if i == 0 else "", f"{f['kind']} {f['target']}", _duration(f["at_s"]), after,
                _fmt("samples/requeued", row.get("samples/requeued", 0)) if last else "",
                _fmt("samples/lost", row["samples/lost"]) if last else "",
            )
    return t


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key == "bound/efficiency":
        return f"{100 * v:.1f}%"
    if key in ("util/gpu", "util/rollout_busy", "util/trainer_busy", "partial/ratio"):
        return f"{100 * v:.0f}%"
    if key == "speedup_vs_sync":
        return f"{v:.2f}x"
    if key == "learn/behaviour_kl":  # below 1e-9 in sync to 1e-1 (a policy moved by stale data)
        return f"{v:.2g}"
    if key.endswith("_to_target"):  # samples or tokens: counts, a mean over seeds included
        return f"{v:,.0f}"
    if key.endswith("_per_s"):
        return f"{v:,.2f}"
    if key.endswith("_s"):
        return _duration(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.2f}"


def published_table(name: str, summary: dict) -> Table:
    """Predicted speedups beside published ones, with how far off each is."""
    """Predicted speedups (trained samples per second: a published step time is at a fixed batch)
    beside published ones, how far off each is, and with ``--band`` whether the published one is
    inside the band's 10th-90th percentile."""
    t = Table(title=f"{name}: predicted vs published", title_justify="left")
    for col in ("variant", "mode", "predicted vs sync", "band p10-p90", "published", "off by", "inside", "source"):
        t.add_column(col, justify="left" if col in ("variant", "mode", "source") else "right")
    for label, entry in summary["variants"].items():
        pub = entry.get("published") or {}
        if "speedup_vs_sync" not in pub:
            continue
        mode = pub.get("mode", "partial")
        row = entry["modes"].get(mode, {})
        pred = row.get("speedup_vs_sync")
        off = f"{100 * (pred / pub['speedup_vs_sync'] - 1):+.0f}%" if pred else "-"
        b = row.get("speedup_band_samples")
        shown = f"{b[0]:.2f}x - {b[2]:.2f}x" if b else "-"
        inside = ("yes" if b[0] <= pub["speedup_vs_sync"] <= b[2] else "no") if b else "-"
        t.add_row(label, mode, _fmt("speedup_vs_sync", pred), shown, _fmt("speedup_vs_sync", pub["speedup_vs_sync"]), off, inside,
                  str(pub.get("source", "")))
    return t


def sweep_table(name: str, mode: str, axes: list[tuple[str, str]], rows: list[dict], objective: str, best: dict | None) -> Table:
    """One row per sweep point (``axes``: (name, column title)); the best one marked, refused and
    failed points with their reason, points over a constraint with the constraint."""
    shown = ("throughput/trained_samples_per_s", "throughput/trained_tokens_per_s")
    titles = {"throughput/trained_samples_per_s": "samples/s", "throughput/trained_tokens_per_s": "tokens/s"}
    extra = objective not in shown
    t = Table(
        title=f"{name}: sweep, {mode} mode ranked by {objective}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
        caption="samples/s, tokens/s: trained samples and tokens per second; stale: max staleness; *: best under the constraints.",
        caption_justify="left",
    )
    for _, title in axes:
        t.add_column(title, no_wrap=True)
    if extra:
        t.add_column(objective, justify="right", no_wrap=True)
    for key in shown:
        t.add_column(titles[key] + (" (objective)" if key == objective else ""), justify="right", no_wrap=True)
    for title in ("stale", "of bound", "GPUs", "status"):
        t.add_column(title, justify="left" if title == "status" else "right", no_wrap=title != "status")
    for row in rows:
        m = row["metrics"]
        cells = [row["values"][a] for a, _ in axes]
        if row["status"] in ("refused", "failed"):
            blank = len(shown) + 4 + extra - 1
            t.add_row(*cells, *["-"] * blank, f"{row['status']}: {row['reason']}", style="dim")
            continue
        if extra:
            cells.append(_fmt(objective, m.get(objective)))
        cells += [_fmt(k, m.get(k)) for k in shown]
        cells += [_fmt("staleness/max", m.get("staleness/max")), _fmt("bound/efficiency", m.get("bound/efficiency")), str(m.get("gpus"))]
        status = "*best" if row is best else ("ok" if row["status"] == "ok" else f"violates {row['reason']}")
        t.add_row(*cells, status, style="bold" if row is best else None)
    return t
