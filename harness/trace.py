"""Every worker's spans as a Chrome trace (``<mode>/trace.json``), for Perfetto's trace viewer
(ui.perfetto.dev) or chrome://tracing.

One process per role (the trainer, the rollout engines, an env run's learner and samplers), one
thread (a track) per worker, named by metadata events; a span is a complete event (``ph: X``),
timestamps in microseconds of the run's clock (simulated on the sim). The run's own track holds
trained samples as a counter and each injected fault from its strike to its recovery.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.model.result import RunResult
from core.store.checkpoint import write_atomic

US = 1e6
RUN = "run"  # the process of whole-run tracks: progress counters, faults


def llm_trace(result: RunResult) -> dict:
    """A mode of an LLM scenario: the trainer, the rollout side's sync pauses, each engine."""
    spans = result.timeline.spans
    engines = [e.name for e in result.engines]
    rows = [("trainer", "trainer", spans.get("trainer", []))]
    rows.append(("rollout", "rollout (all engines paused)", spans.get("rollout", [])))
    rows += [("rollout", name, spans.get(name, [])) for name in engines]
    known = {"trainer", "rollout", *engines}
    rows += [(name, name, rows_) for name, rows_ in spans.items() if name not in known]
    counters = [("trained samples", t, n) for t, n in result.ledger.step_ends]
    faults = [(f"{r.kind} {r.target}", r.at_s, r.recovered_s) for r in result.faults.records]
    clock = "simulated seconds" if result.scenario.runtime == "sim" else "seconds since the run's start"
    return chrome_trace(rows, counters, faults, {"scenario": result.scenario.name, "mode": result.mode, "clock": clock})


def env_trace(spans: dict[str, list], scenario: str, mode: str, seed: int) -> dict:
    """A run of an env scenario: the learner, each sampler (sync mode: its one loop)."""
    rows = [("samplers" if name.startswith("sampler") else name, name, rows_) for name, rows_ in spans.items()]
    meta = {"scenario": scenario, "mode": mode, "seed": seed, "clock": "seconds of training (evaluations left out)"}
    return chrome_trace(rows, [], [], meta)


def chrome_trace(rows: list[tuple[str, str, list]], counters: list[tuple[str, float, float]],
                 faults: list[tuple[str, float, float | None]], meta: dict) -> dict:
    """``rows``: (process, thread, spans ``[kind, start_s, end_s]``) in display order;
    ``counters``: (name, at_s, value); ``faults``: (name, at_s, recovered_s or None)."""
    events: list[dict] = []
    pids: dict[str, int] = {}

    def process(name: str) -> int:
        if name not in pids:
            pid = pids[name] = len(pids) + 1
            events.append(_meta("process_name", pid, 0, {"name": name}))
            events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        return pids[name]

    for tid, (proc, thread, spans) in enumerate(rows, start=1):
        pid = process(proc)
        events.append(_meta("thread_name", pid, tid, {"name": thread}))
        events.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        for kind, start, end in spans:
            events.append({"name": kind, "cat": kind, "ph": "X", "ts": _us(start), "dur": _us(end - start),
                           "pid": pid, "tid": tid, "args": {}})
    if counters or faults:
        pid, tid = process(RUN), len(rows) + 1
        if faults:
            events.append(_meta("thread_name", pid, tid, {"name": "faults"}))
        for name, at, value in counters:
            events.append({"name": name, "ph": "C", "ts": _us(at), "pid": pid, "tid": tid, "args": {"value": value}})
        for name, at, recovered in faults:
            # Unrecovered: an instant, since no end can be drawn.
            if recovered is None:
                events.append({"name": name, "cat": "fault", "ph": "i", "s": "p", "ts": _us(at), "pid": pid, "tid": tid,
                               "args": {"recovered": False}})
            else:
                events.append({"name": name, "cat": "fault", "ph": "X", "ts": _us(at), "dur": _us(recovered - at),
                               "pid": pid, "tid": tid, "args": {"recovered": True}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def write_trace(path: Path, trace: dict) -> None:
    write_atomic(path, json.dumps(trace, separators=(",", ":")).encode())


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _us(seconds: float) -> float:
    return round(seconds * US, 3)  # nanoseconds are the finest a trace viewer draws
