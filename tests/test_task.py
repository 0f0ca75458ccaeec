"""The letters task's reward, on text (core/real/task.py)."""

from __future__ import annotations

import pytest

from core.model.config import Scenario, with_changes
from core.real.task import score_text

PROMPT = "a c ="  # k = 2: full length at 2 x 2**2 = 8 words with the default length_per_letter


def test_reward_is_the_share_of_prompt_letters_times_the_length_reached():
    assert score_text(PROMPT, "a c a c a c a c <eos>", 2, 0.0, 0.0) == 1.0
    assert score_text(PROMPT, "a c a c <eos>", 2, 0.0, 0.0) == 0.5  # half the length
    assert score_text(PROMPT, "a c a b <eos>", 2, 0.0, 0.0) == 0.75 * 0.5  # one word of four not in the prompt
    assert score_text(PROMPT, "a c a c a c a c a c a c <eos>", 2, 0.0, 0.0) == 1.0  # longer is not better
    assert score_text(PROMPT, "<eos> a c", 2, 0.0, 0.0) == 0.0  # nothing before <eos>


def test_a_response_that_runs_into_the_cap_scores_zero_unless_it_keeps_a_share():
    text = "a c a c a c a c a c"  # no <eos>: it ran into the cap
    assert score_text(PROMPT, text, 2, 0.0, 0.0) == 0.0
    assert score_text(PROMPT, text, 2, 0.5, 0.0) == 0.5
    assert score_text(PROMPT, text + " <eos>", 2, 0.5, 0.0) == 1.0  # a stopped one keeps all


def test_with_overshoot_the_reward_peaks_at_the_target():
    exact = "a c a c a c a c <eos>"  # 8 words, the target
    double = "a c a c a c a c a c a c a c a c <eos>"
    assert score_text(PROMPT, exact, 2, 0.0, 1.0) == 1.0
    assert score_text(PROMPT, double, 2, 0.0, 1.0) == 0.5  # (8 / 16) ** 1
    assert score_text(PROMPT, double, 2, 0.0, 2.0) == 0.25
    assert score_text(PROMPT, "a c a c <eos>", 2, 0.0, 1.0) == 0.5  # below the target nothing changes


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_truncated_reward_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="task.truncated_reward"):
        with_changes(Scenario(), {"task.truncated_reward": value})
