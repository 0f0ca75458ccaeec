"""fit_phases inverts the cost model: phase times the model itself gives are fitted back to the
inputs that gave them; and the published verl table is reproduced at its fitted setup."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from core.model.config import Scenario, with_changes
from core.sim.phase_fit import fit_phases, phase_times

INPUTS = {
    "model": {"vocab": 152064},
    "workload": {"group_size": 8, "prompt_tokens": 200, "max_response_len": 6000, "response_sigma": 1.0},
    "trainer": {"batch_size": 64, "sync_every": 2, "mfu": 0.45, "activation_recompute": True},
}


# Trainers that span nodes, priced with their data-parallel collectives (4 optimizer steps a trainer step).
ACROSS_NODES = {**INPUTS, "gpu": {"gpus_per_node": 1, "interconnect_gb_s": 25.0},
                "trainer": {**INPUTS["trainer"], "minibatch_size": 16}}


def _table(truth: dict, rollout: int = 2, trainer: int = 2, inputs: dict = INPUTS) -> dict:
    sc = with_changes(Scenario.model_validate(inputs), {"resources.rollout_gpus": rollout, "resources.trainer_gpus": trainer, **truth})
    setup = {"rollout_gpus": rollout, "trainer_gpus": trainer, "colocated_gpus": rollout + trainer}
    t = phase_times(sc, setup, samples=128)
    colocated = {"gen_s": t["colocated.gen_s"], "old_log_prob_s": t["colocated.old_log_prob_s"],
                 "update_actor_s": t["colocated.update_actor_s"]}
    colocated["step_s"] = sum(colocated.values()) + t["colocated.other_s"]
    setup.update(colocated=colocated, separated={"update_actor_s": t["separated.update_actor_s"]})
    return {"scenario": inputs, "samples_per_step": 128, "fit": "a", "setups": {"a": setup}}


@pytest.mark.parametrize("truth", [
    {"workload.response_median": 700, "rollout.decode_overhead_s": 0.004, "trainer.colocated_mfu": 0.2, "sync.colocated_switch_s": 6.0},
    {"workload.response_median": 250, "rollout.decode_overhead_s": 0.012, "trainer.colocated_mfu": 0.45, "sync.colocated_switch_s": 0.5},
])
@pytest.mark.parametrize("inputs", [INPUTS, ACROSS_NODES], ids=["one node", "across nodes"])
def test_fit_recovers_the_inputs_that_gave_the_phase_times(truth, inputs):
    changes, lines = fit_phases(_table(truth, inputs=inputs))
    assert changes["workload.response_median"] == pytest.approx(truth["workload.response_median"], rel=0.01)
    assert changes["rollout.decode_overhead_s"] == pytest.approx(truth["rollout.decode_overhead_s"], rel=0.02)
    assert changes["trainer.colocated_mfu"] == pytest.approx(truth["trainer.colocated_mfu"], rel=0.02)
    assert changes["sync.colocated_switch_s"] == pytest.approx(truth["sync.colocated_switch_s"], abs=0.01)
    assert any("colocated.gen_s" in line for line in lines)
    assert any("data-parallel collectives" in line for line in lines) == (inputs is ACROSS_NODES)


def test_published_verl_table_is_reproduced_at_its_fitted_setup():
    table = yaml.safe_load(Path("scenarios/published/verl-fully-async-7b.yaml").read_text())
    changes, lines = fit_phases(table)
    sc = with_changes(Scenario.model_validate(table["scenario"]), changes)
    setup = table["setups"][table["fit"]]
    t = phase_times(with_changes(sc, {"resources.rollout_gpus": 16, "resources.trainer_gpus": 16}), setup, table["samples_per_step"])
    assert t["colocated.gen_s"] == pytest.approx(setup["colocated"]["gen_s"], rel=0.01)
    assert t["separated.update_actor_s"] == pytest.approx(setup["separated"]["update_actor_s"], rel=0.01)
    both = setup["colocated"]["update_actor_s"] + setup["colocated"]["old_log_prob_s"]
    assert t["colocated.update_actor_s"] + t["colocated.old_log_prob_s"] == pytest.approx(both, rel=0.01)
    # only the 16:16 phase times are fitted: the other rows, checked as well formed, change nothing
    for label in ("32:32", "64:64"):
        table["setups"][label]["colocated"]["gen_s"] *= 3
        table["setups"][label]["separated"]["update_actor_s"] /= 2
    assert fit_phases(table)[0] == changes
    table["setups"]["32:32"] = {"nonsense": True}
    with pytest.raises(ValidationError, match="setups.32:32"):
        fit_phases(table)
