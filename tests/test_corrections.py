"""Every off-policy correction (core/real/corrections.py) against its loss computed by hand, per
token and with masks, on one fixed small batch chosen so that each of them truncates, masks or
clips something; and the shares the report shows."""

from __future__ import annotations

import math

import pytest
import torch

from core.model.config import RECOMPUTES_PROX, LearnSpec
from core.real.corrections import CORRECTIONS, correction_loss
from core.real.grpo import second_moment_mask

CAP, EPS, M2 = 2.0, 0.2, 0.04
# Two responses of 3 trained tokens each; row 0's last position and row 1's first are not trained
# (padding, a prompt token or a tool's output).
MASK = [[1, 1, 1, 0], [0, 1, 1, 1]]
ADV = [1.0, -0.5]
WEIGHT = [1.0, 2.0]  # each sample's own weight (a prioritized replay draw's)
# log pi_prox - log mu per token: row 0 has one weight over the cap (e^1) and one under 1/cap
# (e^-0.9); row 1's product, e^(0.3 + 0.2 + 0.5) = e, is over the cap.
PROX_MINUS_BEH = [[0.1, 1.0, -0.9, 5.0], [7.0, 0.3, 0.2, 0.5]]
# log pi_theta - log pi_prox: 0.3 takes row 0's ratio over 1 + eps (clipped, A > 0); -0.3 takes
# row 1's under 1 - eps (clipped, A < 0).
THETA_MINUS_PROX = [[0.3, 0.0, -0.1, 9.0], [-4.0, -0.3, 0.1, 0.0]]
BEH = [[-1.0, -2.0, -1.5, -3.0], [-0.5, -1.2, -2.2, -0.7]]


def _tensors():
    beh = torch.tensor(BEH)
    prox = beh + torch.tensor(PROX_MINUS_BEH)
    lp = (prox + torch.tensor(THETA_MINUS_PROX)).requires_grad_(True)
    adv = torch.tensor([[a] * 4 for a in ADV])
    return lp, prox, beh, adv, torch.tensor(MASK, dtype=torch.float32), torch.tensor(WEIGHT).reshape(2, 1)


def _ppo(r: float, a: float) -> tuple[float, bool]:
    clipped = min(max(r, 1 - EPS), 1 + EPS) * a
    return min(r * a, clipped), clipped < r * a


def _by_hand(correction: str) -> tuple[float, dict]:
    """The loss and the stats, token by token, from the formulas in the module's docstring."""
    total, st = 0.0, dict(is_weight_sum=0.0, is_truncated=0, masked=0, clipped=0)
    tokens = [(i, t) for i in range(2) for t in range(4) if MASK[i][t]]
    ntok = len(tokens)
    # M2PO: drop the largest squared log weights until the mean of the rest is at most M2.
    sq = sorted((PROX_MINUS_BEH[i][t] ** 2, (i, t)) for i, t in tokens)
    keep_m2 = set()
    for k in range(len(sq), 0, -1):
        if sum(v for v, _ in sq[:k]) / k <= M2:
            keep_m2 = {it for _, it in sq[:k]}
            break
    for i, t in tokens:
        a = ADV[i]
        log_pb = PROX_MINUS_BEH[i][t]  # log pi_prox / mu
        log_tp = THETA_MINUS_PROX[i][t]  # log pi_theta / pi_prox
        lp = BEH[i][t] + log_pb + log_tp
        seq = sum(PROX_MINUS_BEH[i][u] for u in range(4) if MASK[i][u])
        clip = False
        if correction == "bypass":
            w = 1.0
            per, clip = _ppo(math.exp(log_pb + log_tp), a)
            per = -per
        elif correction == "tis":
            # pi here is the trained policy itself (no proximal pass)
            raw = math.exp(log_pb + log_tp)
            w = min(raw, CAP)
            st["is_truncated"] += raw > CAP
            per = -w * a * lp
        elif correction == "m2po":
            w = 1.0 if (i, t) in keep_m2 else 0.0
            st["masked"] += w == 0.0
            per = -w * math.exp(log_tp) * a
        else:
            raw = math.exp(seq if correction.startswith("seq") else log_pb)
            if correction in ("decoupled", "seq_tis"):
                w = min(raw, CAP)
                st["is_truncated"] += raw > CAP
            elif correction == "icepop":
                w = raw if 1 / CAP <= raw <= CAP else 0.0
                st["masked"] += w == 0.0
            else:  # seq_mis
                w = raw if raw <= CAP else 0.0
                st["masked"] += w == 0.0
            ppo, clip = _ppo(math.exp(log_tp), a)
            per = -w * ppo
        st["is_weight_sum"] += w
        st["clipped"] += clip
        total += per * WEIGHT[i]
    return total / ntok, st


def _run(correction: str):
    lp, prox, beh, adv, mask, weight = _tensors()
    return correction_loss(
        correction, lp, prox if correction in RECOMPUTES_PROX else None, beh, adv, mask, weight,
        is_cap=CAP, clip_eps=EPS, second_moment=lambda lw, m: second_moment_mask(lw, m, M2),
    )


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_each_correction_is_its_loss_by_hand(correction):
    loss, st = _run(correction)
    want, want_st = _by_hand(correction)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert st["ntok"] == 6
    assert st["is_weight_sum"] == pytest.approx(want_st["is_weight_sum"], rel=1e-5)
    for k in ("is_truncated", "masked", "clipped"):
        assert st[k] == want_st[k], k


def test_the_batch_exercises_every_branch():
    # Each correction truncates, masks or clips something here, so a test above that passes is
    # not passing on an untouched path.
    seen = {c: _by_hand(c)[1] for c in CORRECTIONS}
    assert seen["tis"]["is_truncated"] and seen["decoupled"]["is_truncated"] and seen["seq_tis"]["is_truncated"] == 3
    assert seen["icepop"]["masked"] == 2 and seen["seq_mis"]["masked"] == 3 and seen["m2po"]["masked"]
    assert seen["bypass"]["clipped"] and seen["decoupled"]["clipped"]
    # the sequence forms differ from the token forms on this batch
    assert _by_hand("seq_tis")[0] != pytest.approx(_by_hand("decoupled")[0])


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_only_the_trained_policy_is_differentiated(correction):
    # The behaviour and proximal log-probs are data, even when handed over with a graph: a
    # weight or an old policy that took a gradient would be a different loss.
    lp, prox, beh, adv, mask, weight = _tensors()
    beh = beh.clone().requires_grad_(True)
    prox = prox.clone().requires_grad_(True) if correction in RECOMPUTES_PROX else None
    loss, _ = correction_loss(correction, lp, prox, beh, adv, mask, weight, is_cap=CAP, clip_eps=EPS,
                              second_moment=lambda lw, m: second_moment_mask(lw, m, M2))
    loss.backward()
    assert lp.grad is not None and float(lp.grad.abs().sum()) > 0
    assert beh.grad is None and (prox is None or prox.grad is None)
    # no gradient reaches a position that is not trained
    assert float(lp.grad[0, 3]) == 0.0 and float(lp.grad[1, 0]) == 0.0


def test_a_huge_sequence_weight_is_capped_or_rejected_not_inf():
    lp, prox, beh, adv, mask, weight = _tensors()
    prox = prox + 400.0 * mask  # a product of e^1200: overflows float32
    for correction in ("seq_tis", "seq_mis", "icepop", "decoupled"):
        loss, st = correction_loss(correction, lp, prox, beh, adv, mask, weight, is_cap=CAP, clip_eps=EPS)
        assert math.isfinite(float(loss.detach())), correction
        assert math.isfinite(st["is_weight_sum"]), correction


def test_the_earlier_names_are_refused_with_the_new_one():
    for old, new in (("none", "bypass"), ("masked", "icepop")):
        with pytest.raises(ValueError, match=f"renamed '{new}'"):
            LearnSpec(correction=old)


def test_the_report_weighs_each_steps_shares_by_its_tokens():
    from harness.metrics import learning_stability

    steps = [
        {"response_tokens": 100, "is_truncated_frac": 0.1, "masked_frac": 0.0, "clip_frac": 0.2, "behaviour_kl": 0.0},
        {"response_tokens": 300, "is_truncated_frac": 0.0, "masked_frac": 0.4, "clip_frac": 0.0, "behaviour_kl": 0.0},
    ]
    m = learning_stability(steps)
    assert m["learn/truncated_share"] == pytest.approx(0.025)
    assert m["learn/masked_share"] == pytest.approx(0.3)
    assert m["learn/clipped_share"] == pytest.approx(0.05)
    assert "learn/masked_share" not in learning_stability([{"behaviour_kl": 0.0}])  # the sim: nothing to say
