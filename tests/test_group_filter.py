"""Dynamic sampling (``filter:``) and over-provisioning (``rollout.overprovision``) on the sim:
what is dropped and why, that batches stay full and the ledger closes, how far admission runs
ahead, and what a cut surplus costs in off-policy tokens."""

import pytest

from core.model.config import ConfigError, FilterSpec, Scenario, with_changes
from core.model.run_plan import RunPlan
from core.pipeline.group_filter import ABOVE_BAND, BELOW_BAND, LOW_VARIANCE, NO_VARIANCE, FilterStarved, GroupFilter
from core.runtimes.dispatch import run_mode
from core.sim.workload import Workload
from harness.metrics import collect


def test_verdicts_name_their_reason_and_count_samples():
    f = GroupFilter(FilterSpec(min_mean_reward=0.2, max_mean_reward=0.8), batch_size=8)
    assert f.verdict([1.0, 1.0, 1.0, 1.0]) == NO_VARIANCE
    assert f.verdict([0.0, 0.0, 0.0, 0.5]) == BELOW_BAND  # mean 0.125
    assert f.verdict([1.0, 1.0, 1.0, 0.5]) == ABOVE_BAND  # mean 0.875
    assert f.verdict([0.0, 1.0, 0.0, 1.0]) is None
    assert (f.passed, f.dropped) == (4, 12)
    assert f.pass_rate() == 0.25
    low = GroupFilter(FilterSpec(min_reward_std=0.1), batch_size=8)
    assert low.verdict([0.5, 0.5]) == NO_VARIANCE
    assert low.verdict([0.3, 0.5]) == LOW_VARIANCE  # std 0.1, not above it
    assert low.verdict([0.3, 0.51]) is None
    # Zero variance off: only the band judges; equal rewards inside it pass.
    band = GroupFilter(FilterSpec(zero_variance=False, min_mean_reward=0.2), batch_size=8)
    assert band.verdict([0.5, 0.5]) is None and band.verdict([0.0, 0.0]) == BELOW_BAND


def test_the_expected_pass_rate_has_a_floor_and_starts_at_one():
    f = GroupFilter(FilterSpec(min_pass_rate=0.4), batch_size=64)
    assert f.pass_rate() == 1.0  # nothing judged yet: nothing over-admitted
    for _ in range(9):
        f.verdict([0.0, 0.0])
    f.verdict([0.0, 1.0])
    assert f.pass_rate() == 0.4  # 0.1 measured, floored


def test_a_filter_that_drops_everything_fails_in_one_line_instead_of_sampling_forever():
    f = GroupFilter(FilterSpec(starve_batches=2), batch_size=8)
    for _ in range(7):
        f.verdict([0.0, 0.0])
    f.verdict([0.0, 1.0])  # one pass resets the streak
    for _ in range(7):
        f.verdict([1.0, 1.0])
    with pytest.raises(FilterStarved, match=r"2 trainer batches in a row \(16 samples.*fix:"):
        f.verdict([1.0, 1.0])


@pytest.mark.parametrize("data, key", [
    ({"filter": {"zero_variance": False}}, "filter.zero_variance"),
    ({"filter": {"min_mean_reward": 0.5, "max_mean_reward": 0.5}}, "filter.min_mean_reward"),
    ({"filter": {}, "workload": {"group_size": 1}, "trainer": {"batch_size": 4}}, "filter.zero_variance"),
    ({"rollout": {"overprovision": 0.9}}, "rollout.overprovision"),
])
def test_settings_that_cannot_work_are_refused_by_key(data, key):
    with pytest.raises((ConfigError, ValueError), match=key.replace(".", r"\.")):
        Scenario.model_validate(data)


def small(**changes) -> Scenario:
    sc = Scenario.model_validate({
        "resources": {"rollout_gpus": 4, "trainer_gpus": 4},
        "workload": {"group_size": 8, "response_median": 400, "response_sigma": 1.2, "max_response_len": 4096},
        "trainer": {"batch_size": 32, "sync_every": 1, "steps": 30},
        "staleness": {"max_staleness": 1},
    })
    return with_changes(sc, changes)


@pytest.mark.parametrize("mode", ["sync", "async", "partial"])
def test_filtered_runs_train_full_batches_of_groups_with_signal_and_lose_nothing(mode):
    sc = small(**{"filter": {"min_pass_rate": 0.5}})
    result = run_mode(sc, mode)
    m = collect(result)
    led = result.ledger
    rewards = Workload(sc.workload, sc.seed).rewards
    assert m["samples/trainings"] == sc.trainer.steps * sc.trainer.batch_size  # no batch short
    assert m["samples/lost"] == 0 and m["samples/in_flight"] == 0
    assert m["staleness/max"] <= m["staleness/bound"]
    trained = [pid for pid, _, _ in led.trained_log]
    assert all(rewards(pid).std() > 0 for pid in trained)  # every trained group carries signal
    # Every group admitted and done was judged: the ones it dropped had none.
    n_filtered = m["samples/dropped_filter_no_variance"]
    assert n_filtered > 0 and n_filtered % sc.workload.group_size == 0
    assert led.reward_sum / led.rewarded == pytest.approx(sum(rewards(p).mean() for p in trained) / len(trained))


def test_admission_counts_the_expected_pass_rate_apart_from_sync():
    """With a low pass rate, async admits past the plain budget (expected survivors held to it)
    and trains faster than counting every unscored group whole; sync never does."""
    base = small(**{"workload.pass_rate_alpha": 0.3, "workload.pass_rate_beta": 0.3, "filter": {"min_pass_rate": 1.0}})
    expect = with_changes(base, {"filter.min_pass_rate": 0.2})
    assert RunPlan.of(expect, "sync").pass_floor == 1.0 and RunPlan.of(expect, "async").pass_floor == 0.2
    whole, counted = run_mode(base, "async"), run_mode(expect, "async")
    assert counted.end_s < whole.end_s
    for r in (whole, counted):
        assert collect(r)["samples/lost"] == 0 and r.ledger.staleness_max <= 1
    sync_whole, sync_counted = run_mode(base, "sync"), run_mode(expect, "sync")
    assert sync_whole.end_s == sync_counted.end_s  # the same run: colocated GPUs never over-admit


def test_overprovisioned_surplus_is_resumed_in_partial_and_dropped_in_async():
    one, more = small(), small(**{"rollout.overprovision": 1.5})
    assert RunPlan.of(more, "async").surplus == 16  # half a window of 32, whole groups
    p1, p15 = collect(run_mode(one, "partial")), collect(run_mode(more, "partial"))
    a1, a15 = collect(run_mode(one, "async")), collect(run_mode(more, "async"))
    for m in (p1, p15, a1, a15):
        assert m["samples/lost"] == 0 and m["staleness/max"] <= 1
        assert m["samples/trainings"] == 30 * 32
    # Partial: cut groups resume on the next version's weights (more tokens trained
    # off-policy), or are dropped once too stale to train; none is dropped for being cut.
    assert p15.get("samples/dropped_overprovision_cut", 0) == 0
    assert p15["staleness/offpolicy_token_share"] > p1["staleness/offpolicy_token_share"]
    assert p15["samples/dropped_stale_interrupted"] > p1["samples/dropped_stale_interrupted"]
    # Async: the cut surplus is dropped, never trained, its tokens counted as waste.
    assert a15["samples/dropped_overprovision_cut"] > 0 and a15["partial/interrupts"] == 0
    assert a15["tokens/wasted"] > a1["tokens/wasted"]


def test_a_misspelt_key_in_an_optional_section_gets_a_suggestion(tmp_path):
    from harness.scenario import ScenarioError, load

    path = tmp_path / "s.yaml"
    path.write_text("filter: {min_pas_rate: 0.5}\n")
    with pytest.raises(ScenarioError, match=r"filter\.min_pas_rate = 0\.5: unknown key; fix: remove it; did you mean 'min_pass_rate'\?"):
        load(path)
    path.write_text("trainer: {lora: {bogus: 1}}\n")
    with pytest.raises(ScenarioError, match=r"known keys here: rank, alpha, targets"):
        load(path)
