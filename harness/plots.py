"""Plots of one run: the per-worker timeline (generate / train / sync / idle), progress, staleness;
and of every mode together: reward against time and against trained samples."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from core.model.result import RunResult  # noqa: E402
from core.model.timeline import GENERATE, SEND, SYNC, TRAIN  # noqa: E402
from harness.metrics import step_response_len  # noqa: E402

COLORS = {GENERATE: "#2a9d8f", TRAIN: "#264653", SYNC: "#e76f51"}
IDLE = "#eeeeee"
# An env run's timeline: what each actor's spans are.
ENV_KINDS = {
    GENERATE: ("#2a9d8f", "act: envs + policy"),
    SEND: ("#e9c46a", "send to the store (held there by its limit)"),
    TRAIN: ("#264653", "learn"),
    SYNC: ("#e76f51", "weights: publish / fetch"),
}
MODE_COLORS = {"sync": "#264653", "async": "#2a9d8f", "partial": "#e9c46a", "inflight": "#e76f51"}
# The reward figures of every mode, in the run directory beside the modes' own.
REWARD_FIGURES = (
    ("time_s", "reward_vs_time.png", "seconds from the run's start"),
    ("samples", "reward_vs_samples.png", "trained samples"),
)
# An env run's: evaluation return of every mode.
RETURN_FIGURES = (
    ("time_s", "return_vs_time.png", "seconds of training"),
    ("env_steps", "return_vs_env_steps.png", "environment steps"),
)


def _zoom(syncs: list, end: float, versions: int = 4) -> tuple[float, float]:
    """A few sync windows from the middle of the run: steady state, at a readable scale."""
    if len(syncs) < versions + 2:
        return 0.0, end
    i = len(syncs) // 2
    return syncs[i - 1][2], syncs[i + versions - 1][2]


def timeline_png(result: RunResult, path: Path, max_rows: int) -> None:
    """Top: one row per worker over a few versions of steady state (idle is the grey background;
    colocated GPUs train and sync on every row). Bottom: trained samples over the whole run."""
    tl = result.timeline
    end = result.end_s
    engines = [e.name for e in result.engines]
    if len(engines) > max_rows:
        step = len(engines) / max_rows
        engines = [engines[int(i * step)] for i in range(max_rows)]
    trainer_spans = tl.spans.get("trainer", [])
    lo, hi = _zoom([s for s in trainer_spans if s[0] == SYNC], end)
    colocated = result.placement.colocated
    rows = [] if colocated else [("trainer", trainer_spans)]
    for name in engines:
        spans = list(tl.spans.get(name, []))
        if colocated:
            spans += trainer_spans
        else:
            spans += tl.spans.get("rollout", [])
        rows.append((name, spans))

    fig = plt.figure(figsize=(12, 2.4 + 0.22 * len(rows)))
    grid = fig.add_gridspec(2, 2, height_ratios=[max(3, len(rows) / 4), 1.4], width_ratios=[4, 1])
    ax = fig.add_subplot(grid[0, :])
    ax2 = fig.add_subplot(grid[1, 0])
    ax3 = fig.add_subplot(grid[1, 1])
    _span_rows(ax, rows, COLORS, lo, hi)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([n for n, _ in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(lo, hi)
    ax.set_xlabel(f"{_clock(result)} (a few sync windows from the middle of the run)", fontsize=8)
    shown = f"{len(engines)} of {len(result.engines)} engines" if len(engines) < len(result.engines) else f"{len(engines)} engines"
    where = "colocated: every GPU generates, then trains" if colocated else "rollout and trainer GPUs apart"
    ax.set_title(f"{result.scenario.name} / {result.mode}: {shown}, {where}", fontsize=9, loc="left")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLORS.items()] + [Patch(color=IDLE, label="idle")],
        loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=4, frameon=False,
    )
    ends = result.ledger.step_ends
    ax2.plot([0] + [t for t, _ in ends], [0] + [n for _, n in ends], color=COLORS[TRAIN])
    ax2.axvspan(lo, hi, color=COLORS[SYNC], alpha=0.15, linewidth=0)
    ax2.set_xlim(0, end)
    ax2.set_xlabel(f"{_clock(result)}, whole run (shaded: the window above)", fontsize=8)
    ax2.set_ylabel("trained samples", fontsize=8)
    stale = [tv - gv for _, gv, tv in result.ledger.trained_log]
    top = max(stale, default=0)
    ax3.hist(stale, bins=range(top + 2), weights=result.ledger.group_sizes, color=COLORS[GENERATE], align="left", rwidth=0.8)
    ax3.set_xticks(range(top + 1))
    ax3.set_xlabel("staleness of trained samples (versions)", fontsize=8)
    ax3.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _span_rows(ax, rows: list[tuple[str, list]], colors: dict[str, str], lo: float, hi: float) -> None:
    """One bar per row over [lo, hi]: idle grey, then each kind's spans in its colour."""
    for y, (_, spans) in enumerate(rows):
        ax.broken_barh([(lo, hi - lo)], (y - 0.4, 0.8), facecolors=IDLE)
        for kind, color in colors.items():
            bars = [(s, e - s) for k, s, e in spans if k == kind and e > lo and s < hi]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color, linewidth=0)


def env_window(spans: dict[str, list], end: float, versions: int = 4) -> tuple[float, float]:
    """A few weight versions from the middle of an env run (the learner's, or sync mode's loop)."""
    rows = spans.get("learner") or next(iter(spans.values()), [])
    return _zoom([s for s in rows if s[0] == SYNC], end, versions)


def env_timeline_png(spans: dict[str, list], window: tuple[float, float], title: str, path: Path, max_rows: int = 16) -> None:
    """One row per actor (the learner first, then the samplers; sync mode: its one loop) over
    ``window`` (``env_window``'s, the one the report keeps); idle is the grey background."""
    lo, hi = window
    rows = list(spans.items())[:max_rows]
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.3 * len(rows)))
    _span_rows(ax, rows, {k: c for k, (c, _) in ENV_KINDS.items()}, lo, hi)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([n for n, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(lo, hi)
    ax.set_xlabel("seconds of training (a few weight versions from the middle of the run)", fontsize=8)
    shown = f", {len(rows)} of {len(spans)} actors" if len(rows) < len(spans) else ""
    ax.set_title(f"{title}{shown}", fontsize=9, loc="left")
    ax.legend(handles=[Patch(color=c, label=lab) for c, lab in ENV_KINDS.values()] + [Patch(color=IDLE, label="idle / waiting")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=5, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _clock(result: RunResult) -> str:
    return "simulated seconds" if result.scenario.runtime == "sim" else "seconds"


def reward_png(result: RunResult, path: Path) -> None:
    """Mean reward of each trainer step's batch, against trained samples and against wall
    time; held-out evaluations, when any ran, on the time axis."""
    info = [i for i in result.trainer.step_info if "reward_mean" in i]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    a.plot([i["trainings"] for i in info], [i["reward_mean"] for i in info], ".-", color=COLORS[TRAIN], lw=1)
    a.set_xlabel("trained samples")
    a.set_ylabel("mean reward of the step's batch")
    lens = [(i["trainings"], n) for i in info if (n := step_response_len(i)) is not None]
    if lens:
        # Stale data shows first as a swinging response length (learn/length_swing).
        a2 = a.twinx()
        a2.plot([x for x, _ in lens], [y for _, y in lens], "-", color="0.6", lw=0.8)
        a2.set_ylabel("mean response length (tokens)", color="0.45", fontsize=8)
        a2.tick_params(labelsize=7, colors="0.45")
        a2.set_ylim(0, result.scenario.workload.max_response_len)
    b.plot([i["end_s"] for i in info], [i["reward_mean"] for i in info], ".-", color=COLORS[TRAIN], lw=1, label="trained batches")
    ev = result.evaluations
    if ev:
        b.plot([e["done_s"] for e in ev], [e["reward_mean"] for e in ev], "o--", color=COLORS[SYNC], label="held-out prompts")
    b.set_xlabel("wall time (s)")
    b.legend(loc="lower right", fontsize=8)
    for ax in (a, b):
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result.scenario.name} / {result.mode}: reward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def band(curves: list[dict], x: str, points: int = 200) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Several seeds' curves (``x`` and ``reward``) on one grid of ``x``: (grid, mean, min, max),
    linearly interpolated. The grid spans where every seed has a point, so no seed's curve is
    extended past its own data; if they do not overlap at all, it spans them all."""
    lo, hi = max(c[x][0] for c in curves), min(c[x][-1] for c in curves)
    if hi <= lo:
        lo, hi = min(c[x][0] for c in curves), max(c[x][-1] for c in curves)
    grid = np.linspace(lo, hi, points)
    ys = np.array([np.interp(grid, c[x], c["reward"]) for c in curves])
    return grid, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def reward_curves_png(
    curves: dict[str, list[dict]], target: float, title: str, where: Path,
    figures: tuple = REWARD_FIGURES, ylabel: str = "batch reward, trailing mean", per_seed: bool = False,
) -> list[Path]:
    """Trailing mean batch reward of every mode against seconds from the run's start and
    against trained samples, the target as a dashed line (``curves``: per mode, one curve per
    seed, from ``harness.metrics.reward_curve``). One seed: each mode's curve; several: the
    mean over seeds with a min..max band, or with ``per_seed`` every seed's own curve (runs that
    stop at the target end at different points, which a band over their overlap would hide).
    ``figures`` and ``ylabel`` name other axes (an env run's evaluation return against env steps)."""
    written = []
    ys = [y for cs in curves.values() for c in cs for y in c["reward"]] + [target]
    for x, name, xlabel in figures:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for mode, cs in curves.items():
            color = MODE_COLORS.get(mode)
            if len(cs) == 1:
                ax.plot(cs[0][x], cs[0]["reward"], "-", color=color, lw=1.5, label=mode)
                continue
            if per_seed:
                for i, c in enumerate(cs):
                    ax.plot(c[x], c["reward"], "o-", color=color, lw=1.0, ms=3, alpha=0.8,
                            label=f"{mode}: {len(cs)} seeds, one line each" if i == 0 else None)
                continue
            grid, mean, lo, hi = band(cs, x)
            ax.plot(grid, mean, "-", color=color, lw=1.5, label=f"{mode}: mean of {len(cs)} seeds, band min..max")
            ax.fill_between(grid, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.axhline(target, color="#888888", ls="--", lw=1, label=f"target {target:g}")
        ax.set_ylim(min(0.0, min(ys)), max(1.0, max(ys)))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(title, fontsize=9, loc="left")
        fig.tight_layout()
        fig.savefig(where / name, dpi=110)
        plt.close(fig)
        written.append(where / name)
    return written


def grid_heatmap_png(
    path: Path, title: str, rows: tuple[str, list[str]], columns: tuple[str, list[str]],
    cells: list[list[tuple]], best: tuple[int, int] | None, note: str,
) -> None:
    """A grid of values, e.g. a sweep's objective over two axes. ``cells[r][c]`` is (value or
    None, note): a note ("violates", "refused", "failed") greys the cell and is written in it."""
    values = np.array([[v if v is not None and not n else np.nan for v, n in line] for line in cells], dtype=float)
    fig, ax = plt.subplots(figsize=(1.5 + 1.25 * len(columns[1]), 1.4 + 0.6 * len(rows[1])))
    ax.set_facecolor("#dddddd")
    finite = values[np.isfinite(values)]
    im = ax.imshow(values, cmap="viridis", aspect="auto", vmin=finite.min() if finite.size else 0, vmax=finite.max() if finite.size else 1)
    top = finite.max() if finite.size else 0
    for r, line in enumerate(cells):
        for c, (v, n) in enumerate(line):
            text = "-" if v is None else _compact(v)
            if n:
                text = f"{text}\n{n}" if v is not None else n
            light = np.isfinite(values[r, c]) and values[r, c] < 0.6 * top + 0.4 * (finite.min() if finite.size else 0)
            ax.text(c, r, text, ha="center", va="center", fontsize=8, color="white" if light else "black")
    if best is not None:
        r, c = best
        ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="#e63946", linewidth=3))
    ax.set_xticks(range(len(columns[1])), columns[1], fontsize=8)
    ax.set_yticks(range(len(rows[1])), rows[1], fontsize=8)
    ax.set_xlabel(columns[0], fontsize=9)
    ax.set_ylabel(rows[0], fontsize=9)
    ax.set_title(title, fontsize=9, loc="left")
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.text(0.01, 0.01, note, fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _compact(v: float) -> str:
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.2f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


GPU_TIME = (("gpu_time/generate", "generating", COLORS[GENERATE]), ("gpu_time/train", "training", COLORS[TRAIN]),
            ("gpu_time/sync", "syncing", COLORS[SYNC]), ("gpu_time/idle", "idle", "#bbbbbb"))


def summary_png(summary: dict, title: str, path: Path, published: dict | None = None) -> None:
    """The run in one picture: every mode side by side, left its trained-token speedup over sync
    (with the band's 10th-90th percentile where ``--band`` drew one, and a published figure
    where the scenario gives one), right where its GPU-seconds went."""
    modes = list(summary["modes"])
    rows = summary["modes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 1.6 + 0.55 * len(modes)))
    y = np.arange(len(modes))
    speed = [rows[m].get("speedup_vs_sync_tokens") or 0.0 for m in modes]
    left.barh(y, speed, color=[MODE_COLORS.get(m, "#888888") for m in modes], height=0.6)
    for i, m in enumerate(modes):
        b = rows[m].get("speedup_band")
        if b:
            left.errorbar(b[1], i, xerr=[[b[1] - b[0]], [b[2] - b[1]]], fmt="o", color="black", ms=3, capsize=4, lw=1.2,
                          label="band: 10th-90th percentile, median" if i == next(j for j, n in enumerate(modes) if rows[n].get("speedup_band")) else None)
        left.text(0.02 * max(speed + [1.0]), i, f"{speed[i]:.2f}x", va="center", fontsize=8, color="white", fontweight="bold")
    published = published or {}
    for i, m in enumerate(modes):
        if m in published:
            left.plot(published[m], i, "D", color="#e63946", ms=6, label="published" if i == modes.index(next(n for n in modes if n in published)) else None)
    left.axvline(1.0, color="#888888", lw=0.8, ls="--")
    left.set_yticks(y, modes)
    left.invert_yaxis()
    left.set_xlabel("trained tokens per second, x sync")
    left.grid(axis="x", alpha=0.3)
    if left.get_legend_handles_labels()[0]:
        left.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=7, frameon=False)
    start = np.zeros(len(modes))
    for key, label, color in GPU_TIME:
        share = np.array([100.0 * (rows[m].get(key) or 0.0) for m in modes])
        right.barh(y, share, left=start, color=color, height=0.6, label=label)
        start += share
    right.set_yticks(y, [""] * len(modes))
    right.invert_yaxis()
    right.set_xlim(0, 100)
    right.set_xlabel("% of all GPU-seconds")
    right.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
