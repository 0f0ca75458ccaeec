"""What a real run writes for calibration (``<mode>/spans.json``): every engine step, every
trainer step, every weight sync and every trained sample's lengths, read off a RunResult.

``harness/calibrate.py`` fits the sim's cost model to it. A sim run writes none: its
engines keep no per-step rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from core.model.config import MAX_DEVICES, MAX_TOKENS, ConfigError, Scenario, shown
from core.model.result import RunResult
from harness.report import ReportError, read_json

SCHEMA = "asyncrl.spans/1"
# A figure of a row: a count of tokens or sequences, a sum of squared lengths or seconds. Above
# this its square overflows the least-squares fit; no step of any run comes near it.
MAX_FIGURE = 1e18
_FIX = "run the scenario again with this version of asyncrl (harness.run writes spans.json on a real runtime), and calibrate that"


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


class SpansError(ValueError):
    """A spans.json calibration cannot fit: the file, the key, what is wrong and the fix, one line."""


Figure = Annotated[float, Strict(), Field(ge=0, le=MAX_FIGURE, allow_inf_nan=False)]
Seconds = Annotated[float, Strict(), Field(ge=-MAX_FIGURE, le=MAX_FIGURE, allow_inf_nan=False)]
Length = Annotated[int, Strict(), Field(ge=0, le=MAX_TOKENS)]
Devices = Annotated[int, Strict(), Field(ge=1, le=MAX_DEVICES)]


class EngineSpans(BaseModel):
    """One engine's rows: a torch engine's decode steps and prefills, or vLLM's mixed steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    decode: list[tuple[Figure, Figure, Figure]] = []
    """(sequences running, tokens of context held, seconds) per decode step."""
    prefill: list[tuple[Figure, Figure]] = []
    """(prompt tokens, seconds) per prefill."""
    steps: list[tuple[Figure, Figure, Figure, Figure]] = []
    """(sequences running, context held, prompt tokens, seconds) per vLLM step."""


class SpansPlacement(BaseModel):
    """Where the fitted mode ran."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    colocated: Annotated[bool, Strict()]
    """Rollout and training took turns on the same devices."""
    engines: Devices
    """Inference engines."""
    gpus_per_engine: Devices
    """Devices each engine spans."""
    trainer_gpus: Devices
    """Devices the trainer spans."""


class SpansFile(BaseModel):
    """What ``calibration_spans`` writes, as calibration reads it back."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # its schema is checked before its rows
    mode: str
    """The mode the rows are of."""
    scenario: Scenario
    """The scenario the run ran."""
    placement: SpansPlacement
    """Where it ran."""
    engines: dict[str, EngineSpans]
    """Each engine's rows, by name."""
    train: list[tuple[Figure, Figure, Figure, Figure]]
    """(tokens, sum of squared sequence lengths, seconds, threads) per trainer step."""
    transfer_s: list[Seconds]
    """Each weight sync's transfer (drained to resumed), seconds."""
    drain_s: list[Seconds]
    """Each weight sync's drain, seconds."""
    response_lens: list[Length]
    """Each trained sample's response length, in training order."""
    prompt_lens: list[Length]
    """Each trained sample's prompt length."""
    end_s: Seconds
    """The mode's wall time."""


def read_spans(path: Path, mode: str) -> dict:
    """``path`` as calibration fits it: a spans.json of this schema and ``mode`` whose every row
    has its figures, finite, in range. ``SpansError`` names the first key amiss."""
    try:
        data = read_json(path, _FIX)
    except ReportError as exc:
        raise SpansError(str(exc)) from None
    if data.get("schema") != SCHEMA:
        raise SpansError(f"{path}: not a spans file of schema {SCHEMA} (schema = {shown(data.get('schema'))}); fix: {_FIX}")
    try:
        spans = SpansFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        cause = err.get("ctx", {}).get("error")
        problem = f"{cause.key}: {cause.problem}" if isinstance(cause, ConfigError) else err["msg"].lower()
        value = "" if err["type"] == "missing" else f" = {shown(err.get('input'))}"  # a missing key's input is its parent
        raise SpansError(f"{path}: {key}{value}: {problem}; fix: {_FIX}") from None
    if data["mode"] != mode:
        raise SpansError(f"{path}: the spans of mode {shown(data['mode'])}, not of {mode!r}; fix: {_FIX}")
    return {**data, "scenario": spans.scenario.model_dump(mode="json")}  # defaults filled in
