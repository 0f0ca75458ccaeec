"""The off-policy corrections of the GRPO loss, by the names users know, as one pure function.

A stale token was sampled by the behaviour policy mu (the engine's weights of its version, its
log-prob recorded per token); the trainer holds pi_theta. Per response token t of sample i,
with advantage A_i, mask m_t (response tokens that are trained) and
``PPO(r) = min(r A_i, clip(r, 1-eps, 1+eps) A_i)``:

    bypass     loss_t = -PPO(pi_theta / mu)                the behaviour policy as the old policy:
                                                           no importance weight, the clip alone
                                                           bounds the step (verl's "bypass mode")
    tis        loss_t = -w_t A_i log pi_theta(t)           token-level truncated importance
               w_t = min(pi_theta / mu, C), detached       sampling on the policy gradient (Yao et
                                                           al. 2025, "Your efficient RL framework
                                                           secretly brings you off-policy RL")
    decoupled  loss_t = -w_t PPO(pi_theta / pi_prox)       decoupled PPO (Fu et al. 2025, AReaL):
               w_t = min(pi_prox / mu, C)                  the clip against the proximal policy,
                                                           the truncated weight to mu; verl's
                                                           token-level TIS on PPO is this loss
    icepop     loss_t = -w_t PPO(pi_theta / pi_prox)       IcePop (Ring-1T, inclusionAI 2025):
               w_t = pi_prox / mu if 1/C <= it <= C, else 0  tokens far off are masked, not
                                                           truncated
    seq_tis    loss_t = -W_i PPO(pi_theta / pi_prox)       sequence-level truncated IS: one weight
               W_i = min(prod_t pi_prox / mu, C)           per response, its tokens' product
    seq_mis    loss_t = -W_i PPO(pi_theta / pi_prox)       sequence-level masked IS (Liu et al.
               W_i = prod_t pi_prox / mu if <= C, else 0   2025, "When speed kills stability"):
                                                           a response whose weight passes C is
                                                           rejected whole
    m2po       loss_t = -k_t (pi_theta / pi_prox) A_i      M2PO (Zheng et al. 2025, "Prosperity
               k_t: 0 on the tokens of largest             before collapse"): no clip; only the
               (log pi_prox / mu)^2, as few as keep the    outliers that push the second moment
               mean of the rest <= the threshold           over the threshold are dropped

C is ``learn.is_cap``; weights are detached; pi_prox is the policy at the start of the step
(one no-grad forward, ``RECOMPUTES_PROX``). mu is per token, so a response whose tokens span
versions (partial, inflight) is weighed token by token. The loss is the sum over response
tokens of ``loss_t * sample weight`` over the minibatch's response tokens.

Each call also returns, as sums over response tokens, what the report shows per correction:
the weight, the tokens whose weight was truncated, masked (weight set to 0) and clipped (the
PPO clip active), and the drift KL(mu || pi) (k3 estimator) since they were sampled.
"""

from __future__ import annotations

from typing import Callable, Optional, get_args

import torch

from core.model.config import RECOMPUTES_PROX, Correction

CORRECTIONS: tuple[str, ...] = get_args(Correction)
"""Every correction ``correction_loss`` computes (``learn.correction`` takes one)."""

STATS: tuple[str, ...] = ("is_weight_sum", "is_truncated", "masked", "clipped", "ntok", "drift")
"""The sums ``correction_loss`` returns beside the loss."""


def _ppo(ratio: torch.Tensor, adv: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, and 1 where the clip is the smaller term."""
    s1 = ratio * adv
    s2 = ratio.clamp(1.0 - eps, 1.0 + eps) * adv
    return torch.minimum(s1, s2), (s2 < s1).float()


def _weights(
    correction: str, log_r: torch.Tensor, m: torch.Tensor, cap: float,
    second_moment: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: the importance weight, 1 where the token is kept (0: masked), 1 where its
    weight was truncated at ``cap``. ``log_r``: log pi / mu per token, detached."""
    zero = torch.zeros_like(m)
    if correction == "bypass":
        return m, m, zero
    if correction == "m2po":
        if second_moment is None:
            raise ValueError("m2po needs its second-moment mask")
        kept = second_moment(log_r, m)
        return kept, kept, zero
    # one weight per response for the sequence forms: the product of its tokens'
    log_w = log_r.sum(dim=1, keepdim=True).expand_as(m) if correction in ("seq_tis", "seq_mis") else log_r
    raw = torch.exp(log_w)  # may overflow to inf: clamped or masked below, never multiplied
    if correction in ("tis", "decoupled", "seq_tis"):
        return raw.clamp(max=cap), m, (raw > cap).float() * m
    if correction == "icepop":
        kept = ((raw <= cap) & (raw >= 1.0 / cap)).float() * m
    else:  # seq_mis: rejected above the cap only; a product far below it is kept, small
        kept = (raw <= cap).float() * m
    return torch.where(kept > 0, raw, zero), kept, zero


def correction_loss(
    correction: str,
    lp: torch.Tensor,
    prox: Optional[torch.Tensor],
    beh: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    *,
    is_cap: float,
    clip_eps: float,
    ntok: Optional[torch.Tensor] = None,
    second_moment: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one minibatch under ``correction`` and its stats (sums, ``STATS``).

    ``lp``: log pi_theta per target position, (B, T), with its graph; ``prox``: log pi_prox,
    (B, T), for the corrections in ``RECOMPUTES_PROX`` (else None); ``beh``: log mu; ``adv``:
    the advantage on every position; ``mask``: 1 on the response tokens trained; ``weight``:
    (B, 1), each sample's own weight (a prioritized replay draw's). ``ntok``: the loss
    normaliser, the response tokens of the whole minibatch (every rank's); None: this one's.
    ``second_moment(log_w, mask)``: m2po's kept tokens (the caller gathers across ranks)."""
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown correction {correction!r}: one of {', '.join(CORRECTIONS)}")
    if (correction in RECOMPUTES_PROX) != (prox is not None):
        raise ValueError(f"correction {correction!r} {'needs' if prox is None else 'takes no'} proximal log-probs")
    m = mask
    # Only pi_theta is differentiated: the behaviour and proximal log-probs are data.
    beh = beh.detach()
    prox = None if prox is None else prox.detach()
    ntok = (m.sum() if ntok is None else ntok).clamp(min=1.0)
    # log(pi / mu) per token, pi the proximal policy where the correction has it, else the
    # weights this minibatch is trained with (detached either way).
    log_r = ((lp.detach() if prox is None else prox) - beh) * m
    d = log_r.double()  # k3 = r - 1 - log r in float64: at 1e-5 apart float32's is rounding noise
    drift = (torch.expm1(d) - d).clamp(min=0.0) * m
    w, kept, truncated = _weights(correction, log_r, m, is_cap, second_moment)
    clipped = torch.zeros_like(m)
    if correction == "bypass":
        per_tok, clipped = _ppo(torch.exp((lp - beh) * m), adv, clip_eps)
        per_tok = -per_tok
    elif correction == "tis":
        per_tok = -w * adv * lp
    elif correction == "m2po":
        per_tok = -w * torch.exp((lp - prox) * m) * adv
    else:
        per_tok, clipped = _ppo(torch.exp((lp - prox) * m), adv, clip_eps)
        per_tok = -w * per_tok
    loss = (per_tok * weight * m).sum() / ntok
    stats = {
        "is_weight_sum": float((w * m).sum()),
        "is_truncated": float((truncated * m).sum()),
        "masked": float((m - kept * m).sum()),
        "clipped": float((clipped * m).sum()),
        "ntok": float(m.sum()),
        "drift": float(drift.sum()),
    }
    return loss, stats
