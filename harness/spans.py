"""What a real run writes for calibration (``<mode>/spans.json``): every engine step, every
trainer step, every weight sync and every trained sample's lengths, read off a RunResult.

``harness/calibrate.py`` fits the sim's cost model to it. A sim run writes none: its
engines keep no per-step rows.
"""

from __future__ import annotations

from typing import Optional

from core.model.result import RunResult

SCHEMA = "asyncrl.spans/1"


def calibration_spans(result: RunResult) -> Optional[dict]:
    """The rows calibration fits, or None when no engine recorded its steps."""
    engines = {e.name: e.step_spans for e in result.engines if e.step_spans}
    if not engines:
        return None
    info = [i for i in result.trainer.step_info if "compute_s" in i]
    sync = result.sync
    p = result.placement
    return {
        "schema": SCHEMA,
        "mode": result.mode,
        "scenario": result.scenario.model_dump(mode="json"),
        "placement": {
            "colocated": p.colocated, "engines": p.engines, "gpus_per_engine": p.gpus_per_engine,
            "trainer_gpus": p.trainer_gpus,
        },
        "engines": engines,
        # (tokens, sum of squared sequence lengths, seconds, threads) per trainer step
        "train": [[i["tokens"], i.get("tokens_sq", 0), i["compute_s"], i.get("threads", 0)] for i in info],
        # From rollout drained to resumed: what the sim's weight transfer stands for.
        "transfer_s": [p_ - d for p_, d in zip(sync.pause_s, sync.drain_s)],
        "drain_s": list(sync.drain_s),
        "response_lens": [n for i in info for n in i.get("response_lens", ())],
        "prompt_lens": [n for i in info for n in i.get("prompt_lens", ())],
        "end_s": result.end_s,
    }
