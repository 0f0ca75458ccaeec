"""The accounting and staleness invariants, over many random scenarios, in every mode."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import math

from core.model.config import MODES, Scenario, effective_staleness
from core.model.ledger import Ledger
from core.model.progress import StepTrained
from core.model.timeline import GENERATE, TRAIN
from core.pipeline.wiring import in_flight
from core.runtimes.dispatch import run_mode
from core.model.run_plan import RunPlan
from core.runtimes.inproc import drive
from core.runtimes.sim import connect_sim
from core.sim import virtual_clock
from harness.metrics import collect


@st.composite
def scenarios(draw):
    n = draw(st.sampled_from([1, 2, 4, 8]))
    max_staleness = draw(st.integers(0, 3))
    lead = draw(st.one_of(st.none(), st.floats(0.0, float(max_staleness))))
    gpe = draw(st.sampled_from([1, 2]))
    data = {
        "seed": draw(st.integers(0, 2**31)),
        "resources": {
            "rollout_gpus": gpe * draw(st.integers(1, 4)),
            "trainer_gpus": gpe * draw(st.integers(1, 4)),
            "gpus_per_engine": gpe,
        },
        "workload": {
            "group_size": n,
            "prompt_tokens": draw(st.integers(1, 2048)),
            "response_median": draw(st.integers(1, 3000)),
            "response_sigma": draw(st.floats(0.0, 1.6)),
            "prompt_share": draw(st.floats(0.0, 1.0)),
            "max_response_len": draw(st.integers(1, 8192)),
        },
        "rollout": {
            "max_num_seqs": draw(st.integers(1, 64)),
            "max_concurrency": draw(st.one_of(st.none(), st.integers(n, 8 * n))),
        },
        "trainer": {
            "batch_size": n * draw(st.integers(1, 8)),
            "sync_every": draw(st.integers(1, 4)),
            "steps": draw(st.integers(1, 80)),
            "step_overhead_s": draw(st.floats(0.0, 5.0)),
        },
        "staleness": {"max_staleness": max_staleness, "admission_lead": lead},
        "sync": {"latency_s": draw(st.floats(0.0, 2.0))},
    }
    if draw(st.integers(0, 3)) == 0:  # a quarter of the runs put a replay ring before the trainer
        groups = data["trainer"]["batch_size"] // n
        data["replay"] = {
            "enabled": True,
            "capacity_groups": draw(st.integers(groups, 4 * groups)),
            "reuse": draw(st.floats(1.0, 4.0)),
            "prioritized": draw(st.booleans()),
        }
    if n > 1 and draw(st.integers(0, 3)) == 0:  # a quarter filter groups (dynamic sampling)
        data["filter"] = {"min_pass_rate": draw(st.floats(0.1, 1.0))}
        data["workload"]["pass_rate_alpha"] = draw(st.floats(0.5, 3.0))
        data["workload"]["pass_rate_beta"] = draw(st.floats(0.5, 3.0))
    if draw(st.integers(0, 3)) == 0:  # a quarter over-provision rollout
        data["rollout"]["overprovision"] = draw(st.floats(1.0, 2.0))
    return Scenario.model_validate(data)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), mode=st.sampled_from(MODES))
def test_every_sample_is_accounted_for(sc, mode):
    result = run_mode(sc, mode)  # the ledger itself raises on a double train or a stale train
    m = collect(result)
    led = result.ledger
    assert m["samples/produced"] == m["samples/trained"] + m["samples/dropped"] + m["samples/in_flight"]
    assert m["samples/in_flight"] == 0  # counted in the components once the run ended
    assert m["samples/lost"] == 0
    assert m["samples/trainings"] == sc.trainer.steps * sc.trainer.batch_size
    # The log of trained groups and the counters are two records of the same trainings.
    assert sum(led.group_sizes) == m["samples/trainings"] == led.step_ends[-1][1]
    assert m["staleness/max"] <= m["staleness/bound"]
    assert led.max_response <= sc.workload.max_response_len
    # Only a sync that aborts, or an over-provisioned surplus cut and resumed, interrupts.
    assert led.interrupts == 0 or mode == "partial" or (mode == "inflight" and sc.rollout.overprovision > 1)
    if sc.replay.enabled:
        assert m["samples/trained"] <= m["samples/trainings"]
        assert m["samples/trained"] <= m["replay/added_groups"] * sc.workload.group_size
    else:
        assert m["samples/trained"] == m["samples/trainings"]
        assert m["staleness/bound"] == effective_staleness(sc, mode)[0]
        assert len({pid for pid, _, _ in led.trained_log}) == len(led.trained_log)
    # The queue's own eviction counter and the ledger's stale drops are two views of one event.
    assert m["queue/evicted_groups"] * sc.workload.group_size == m.get("samples/dropped_stale", 0)
    # GPU time is split, never double counted, and each share agrees with the timeline's
    # spans, which are recorded apart from the engines' and the trainer's busy counters.
    busy = m["gpu_time/generate"] + m["gpu_time/train"] + m["gpu_time/sync"]
    assert min(m["gpu_time/generate"], m["gpu_time/train"], m["gpu_time/sync"], m["gpu_time/idle"]) >= 0
    assert busy <= 1 + 1e-9
    place, spans = result.placement, result.timeline.spans
    gpu_s = place.total_gpus * result.end_s

    def span_s(kind: str, rows_of) -> float:
        return sum(b - a for w, rows in spans.items() if rows_of(w) for k, a, b in rows if k == kind)

    generate = span_s(GENERATE, lambda w: w.startswith("engine")) * place.gpus_per_engine / gpu_s
    train = span_s(TRAIN, lambda w: w == "trainer") * place.trainer_gpus / gpu_s
    assert math.isclose(generate, m["gpu_time/generate"], rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(train, m["gpu_time/train"], rel_tol=1e-6, abs_tol=1e-9)


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), mode=st.sampled_from(MODES))
def test_the_ledger_balances_after_every_step_not_only_at_the_end(sc, mode):
    checked = []

    async def main():
        system = None

        def check(event):
            if not isinstance(event, StepTrained):
                return
            led = system.ledger
            assert led.produced == led.trained + led.dropped_total + in_flight(system), f"step {event.step}"
            checked.append(event.step)

        run = connect_sim(RunPlan.of(sc, mode), on_step=check)
        system = run.system
        await drive(run)

    virtual_clock.run(main())
    assert checked == list(range(1, sc.trainer.steps + 1))


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_async_with_zero_staleness_trains_exactly_what_sync_trains(sc):
    from core.model.config import with_changes

    sc = with_changes(sc, {"staleness.max_staleness": 0, "staleness.admission_lead": None, "replay.enabled": False,
                           "rollout.overprovision": 1.0, "filter": None})
    sync, asyn = run_mode(sc, "sync"), run_mode(sc, "async")
    assert sorted(sync.ledger.trained_log) == sorted(asyn.ledger.trained_log)
    assert asyn.ledger.staleness_max == 0


def test_partial_mode_interrupts_and_resumes_each_exactly_once(monkeypatch):
    # Every trained sample: its tokens' staleness summed, and its staleness times its tokens.
    per_sample: list[tuple[int, int]] = []
    trained_groups = Ledger.trained_groups

    def record(self, groups, version, now):
        for g in groups:
            for s in g.samples:
                per_sample.append((sum((version - v) * k for v, k in s.version_spans), (version - g.version) * s.n_response))
        trained_groups(self, groups, version, now)

    monkeypatch.setattr(Ledger, "trained_groups", record)
    sc = Scenario.model_validate({
        "resources": {"rollout_gpus": 2, "trainer_gpus": 2},
        "workload": {"group_size": 4, "response_median": 2000, "response_sigma": 1.2, "max_response_len": 6000},
        "trainer": {"batch_size": 16, "sync_every": 1, "steps": 40},
        "staleness": {"max_staleness": 3, "admission_lead": 1.0},
    })
    system = run_mode(sc, "partial")
    led = system.ledger
    assert led.interrupted > 0, "this workload must interrupt something"
    # The ledger refuses any trained group whose aborts and resumes differ; here both happened.
    assert led.resumes >= 1 and led.interrupts >= led.resumes
    m = collect(system)
    assert m["partial/ratio"] > 0
    assert led.max_response <= 6000
    assert m["samples/lost"] == 0
    # Interrupted samples hold tokens of more than one version, and staleness is measured
    # from their oldest token, so per-token staleness is below per-sample staleness, strictly
    # for some. (The means, one per token and one per sample, are weighted differently and
    # need not compare so.)
    assert per_sample and all(tokens <= whole for tokens, whole in per_sample)
    assert any(tokens < whole for tokens, whole in per_sample)
    assert sum(t for t, _ in per_sample) == led.token_staleness_sum
