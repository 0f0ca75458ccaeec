"""A paper's published per-phase times (``python -m harness.calibrate TABLE.yaml``), as
``core.sim.phase_fit.fit_phases`` reads them: every count whole and bounded, every time a
finite positive number of seconds, the fitted setup one of those listed. Checked before any
search starts, so a bad table is one line naming its key."""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import Field, Strict, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from core.model.config import MAX_DEVICES, MAX_FLOAT, ConfigError, Scenario, _Frozen, refused, shown, with_changes

# The most samples one published step trains (verl's table: 8,192). The fit prices every sample
# of a step, so a table saying 10^12 ran for hours instead of being refused.
MAX_PHASE_SAMPLES = 1_000_000
MAX_SETUPS = 100  # a published table lists a few cluster sizes

Devices = Annotated[int, Strict(), Field(ge=1, le=MAX_DEVICES)]
Seconds = Annotated[float, Strict(), Field(gt=0, le=MAX_FLOAT, allow_inf_nan=False)]


class ColocatedPhases(_Frozen):
    """A colocated run's per-step phase times (verl's timing names)."""

    step_s: Seconds
    """The whole step."""
    gen_s: Seconds
    """Generation (``timing_s/gen``)."""
    old_log_prob_s: Seconds
    """The log-prob recompute (``timing_s/old_log_prob``)."""
    update_actor_s: Seconds
    """The actor update (``timing_s/update_actor``)."""


class SeparatedPhases(_Frozen):
    """A run with rollout and trainer on their own devices."""

    step_s: Optional[Seconds] = None
    """The whole step (shown, not fitted)."""
    gen_s: Optional[Seconds] = None
    """The trainer's wait for generation (shown, not fitted)."""
    update_actor_s: Seconds
    """The actor update: fixes the tokens a sample holds."""


class PhaseSetup(_Frozen):
    """One published cluster size."""

    rollout_gpus: Devices
    """The separated run's rollout devices."""
    trainer_gpus: Devices
    """The separated run's trainer devices."""
    colocated_gpus: Devices
    """The colocated run's devices."""
    colocated: ColocatedPhases
    """The colocated run's phase times."""
    separated: SeparatedPhases
    """The separated run's phase times."""
    speedup_vs_sync: Optional[Annotated[float, Strict(), Field(gt=0, le=MAX_FLOAT, allow_inf_nan=False)]] = None
    """The published end-to-end speed-up against colocated sync (for checking, never fitted)."""


class PhaseTable(_Frozen):
    """A published table of phase times and the scenario inputs the fit completes."""

    scenario: Scenario = Field(default_factory=Scenario)
    """The inputs the fit completes (a scenario file's keys); the rest are defaults."""
    samples_per_step: Annotated[int, Strict(), Field(ge=1, le=MAX_PHASE_SAMPLES)]
    """Samples one published step trains."""
    setups: Annotated[dict[str, PhaseSetup], Field(min_length=1, max_length=MAX_SETUPS)]
    """The published setups, by label."""
    fit: Annotated[str, Strict()]
    """The setup whose phase times are fitted; the others check the prediction."""

    @field_validator("setups")
    @classmethod
    def _placeable(cls, setups: dict[str, PhaseSetup], info: ValidationInfo) -> dict[str, PhaseSetup]:
        """Each setup's separated and colocated runs can be placed with the scenario's engines."""
        base = info.data.get("scenario")
        for label, setup in setups.items() if base is not None else ():
            g = setup.colocated_gpus
            for keys, gpus in ((("rollout_gpus", "trainer_gpus"), (setup.rollout_gpus, setup.trainer_gpus)),
                               (("colocated_gpus",), (g // 2 + g % 2, g // 2))):
                try:
                    with_changes(base, {"resources.rollout_gpus": gpus[0], "resources.trainer_gpus": gpus[1]})
                except ValidationError as exc:
                    raise _unplaceable(label, " and ".join(keys), exc.errors()[0]) from None
        return setups

    @field_validator("fit")
    @classmethod
    def _listed(cls, fit: str, info: ValidationInfo) -> str:
        setups = info.data.get("setups")
        if setups is not None and fit not in setups:
            raise refused("is not a setup of the table", f"use one of {sorted(setups)}")
        return fit


def _unplaceable(label: str, keys: str, err: dict) -> PydanticCustomError:
    """A setup whose GPU counts the scenario cannot place: what they give, and its fix."""
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        given, value, problem, fix = cause.key, cause.value, cause.problem, cause.fix
    else:
        given, value = ".".join(map(str, err["loc"])), err.get("input")
        problem, fix = err["msg"].lower(), err.get("ctx", {}).get("fix", f"give {keys} GPU counts the scenario can place")
    return refused(f"setup {label!r}: its {keys} give {given} = {shown(value)}: {problem}", fix)
