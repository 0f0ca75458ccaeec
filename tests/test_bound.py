"""The pipeline bound is an upper bound: no mode beats it on the scenarios it describes."""

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from core.sim.bound import pipeline_bound
from core.model.config import Scenario
from core.runtimes.dispatch import run_mode


@st.composite
def workloads(draw):
    n = draw(st.sampled_from([4, 8, 16]))
    ms = draw(st.integers(1, 3))
    groups = draw(st.integers(2, 8))
    replay = {"enabled": False}
    if draw(st.integers(0, 3)) == 0:
        replay = {
            "enabled": True,
            "capacity_groups": draw(st.integers(groups, 4 * groups)),
            "reuse": draw(st.floats(1.0, 4.0)),
            "prioritized": draw(st.booleans()),
        }
    return Scenario.model_validate({
        "seed": draw(st.integers(0, 1000)),
        "resources": {"rollout_gpus": draw(st.integers(1, 6)), "trainer_gpus": draw(st.integers(1, 6))},
        "workload": {
            "group_size": n,
            "response_median": draw(st.integers(100, 2000)),
            "response_sigma": draw(st.floats(0.2, 1.3)),
            "max_response_len": draw(st.integers(2000, 16000)),
        },
        "trainer": {"batch_size": n * groups, "sync_every": draw(st.integers(1, 4)), "steps": 60},
        "staleness": {"max_staleness": ms, "admission_lead": draw(st.floats(0.1, float(ms)))},
        "replay": replay,
    })


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(sc=workloads(), mode=st.sampled_from(["sync", "async", "partial"]))
def test_no_mode_beats_its_bound(sc, mode):
    system = run_mode(sc, mode)
    led = system.ledger
    # Evictions change the trained set (see core/sim/bound.py); a replay ring always leaves some
    # groups untrained, which is what it trades for reuse.
    assume(led.dropped["stale"] + led.dropped["stale_on_arrival"] == 0)
    assume(sc.replay.enabled or led.dropped_total == 0)
    measured = led.trainings / system.end_s
    bound = pipeline_bound(sc, mode)
    # The cohort clock thins the batch by the whole length distribution, but a whole group shares
    # one engine, so a short group's own members leave early and it finishes a little sooner than
    # the clock says. On a few engines a run can beat the bound by that (1.0 % seen, not more).
    # With replay the trained set is a random draw from the ring, priced in the bound at the
    # ring's mean group; a draw of cheaper groups beats that by a little (3.5 % at most seen).
    assert measured <= bound.trained_samples_per_s * (1.05 if sc.replay.enabled else 1.02)
    assert bound.trained_samples_per_s <= bound.resource_samples_per_s * (1 + 1e-9)


def test_sync_sits_far_below_its_bound_on_a_long_tail_and_partial_near_it():
    sc = Scenario.model_validate({
        "resources": {"rollout_gpus": 4, "trainer_gpus": 12},
        "workload": {"max_response_len": 16384},
        "trainer": {"batch_size": 256, "sync_every": 4, "steps": 120},
        "staleness": {"max_staleness": 2, "admission_lead": 0.5},
    })
    eff = {}
    for mode in ("sync", "partial"):
        s = run_mode(sc, mode)
        eff[mode] = s.ledger.trained / s.end_s / pipeline_bound(sc, mode).trained_samples_per_s
    assert eff["sync"] < 0.7
    assert eff["partial"] > 0.85
