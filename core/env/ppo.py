"""PPO on segments acted by an older policy: the on-policy learner of the env pipeline, for a
learner that runs behind its samplers (IMPALA's setting), and the stochastic policy its samplers
act with.

A batch is whole segments: per environment, ``send_every`` consecutive steps acted by one
behaviour policy mu (the version the sampler held). The learner's own policy at the batch's
start is pi_prox. ``ppo.lag_correction`` chooses how the lag between them is corrected:

``clip`` (the default). PPO's ratio is pi/mu: the learner treats the lagged rows as PPO treats
its own batch after the first epoch, and the clip truncates the importance weight. Advantages
are GAE(lambda) on the learner's values. This is PPO run one step off-policy, as verl and slime
run it for LLMs.

``vtrace``. The truncated ratio pi_prox/mu corrects the targets (Espeholt et al. 2018):

    rho_t = min(rho_bar, pi_prox(a_t|x_t) / mu(a_t|x_t))      c_t = lambda * min(c_bar, pi_prox / mu)
    delta_t = rho_t * (r_t + g_t V(x'_t) - V(x_t))            g_t = gamma, or 0 if x'_t is terminal
    v_t - V(x_t) = delta_t + g_t c_t (v_{t+1} - V(x_{t+1}))    cut at an episode's end and at the segment's

and the clip is taken to pi_prox (decoupled PPO, Hilton et al. 2021; AReaL uses it for LLMs).
On CartPole at a lag of one version it needed 2.3x the env steps of ``clip`` (bench/ppo_lag_sim.py): with 20
epochs per batch, half the ratios are truncated, and the advantages of actions the learner has
already turned from shrink by their ratio.

x'_t is the observation after step t: at a time-limit truncation the final observation, so a
truncated episode bootstraps and only a termination ends the return. ``clip``'s GAE is the
recursion above with every rho and c/lambda 1. With no lag (sync mode) pi_prox = mu and the two
corrections are the same: stable-baselines3's PPO.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from core.env.net_state import (
    adam_arrays, adam_step, clip_flat_, flat_grads, generator_state, load_adam, load_generator, load_into, weights_of,
)
from core.model.env_config import PPOSpec


class ActorCritic(nn.Module):
    """Separate MLPs (tanh) for the policy and the value, as stable-baselines3's default policy;
    a categorical head for discrete actions, a diagonal Gaussian with a learned log std for
    continuous ones."""

    def __init__(self, obs_dim: int, actions: int, discrete: bool, hidden: tuple[int, ...], log_std_init: float) -> None:
        super().__init__()
        self.discrete = discrete
        self.pi = _mlp(obs_dim, hidden, actions, head_gain=0.01)
        self.vf = _mlp(obs_dim, hidden, 1, head_gain=1.0)
        if not discrete:
            self.log_std = nn.Parameter(torch.full((actions,), float(log_std_init)))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        out = self.pi(obs)
        if self.discrete:
            return torch.distributions.Categorical(logits=out)
        return torch.distributions.Independent(torch.distributions.Normal(out, self.log_std.exp().expand_as(out)), 1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.vf(obs).squeeze(-1)

    def log_prob_entropy(self, obs: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi(act | obs) and the policy's entropy at obs: ``dist``'s numbers, for the learner's
        minibatch step, where building and validating a Distribution costs more than the net."""
        out = self.pi(obs)
        if self.discrete:
            logp_all = _log_probs(out)
            return logp_all.gather(-1, act.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
        d = torch.distributions.Normal(out, self.log_std.exp().expand_as(out), validate_args=False)
        return d.log_prob(act).sum(-1), d.entropy().sum(-1)

    def mode(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.pi(obs)
        return out.argmax(-1) if self.discrete else out


def _mlp(inp: int, hidden: tuple[int, ...], out: int, head_gain: float) -> nn.Sequential:
    # Orthogonal initialisation with a small policy head, as stable-baselines3 and the PPO
    # implementation-details study (Huang et al. 2022) use: the first policy is near uniform.
    layers: list[nn.Module] = []
    width = inp
    for h in hidden:
        lin = nn.Linear(width, h)
        nn.init.orthogonal_(lin.weight, np.sqrt(2))
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.Tanh()]
        width = h
    head = nn.Linear(width, out)
    nn.init.orthogonal_(head.weight, head_gain)
    nn.init.zeros_(head.bias)
    layers.append(head)
    return nn.Sequential(*layers)


class StochasticPolicy:
    """Samples actions from a copy of the learner's policy; reports each action's log-probability."""

    def __init__(self, net: ActorCritic, seed: int) -> None:
        self.net = net
        self.gen = torch.Generator().manual_seed(seed)
        self.version = 0

    def act(self, obs: np.ndarray, env_steps: int) -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            x = torch.as_tensor(obs, dtype=torch.float32)
            if not self.net.discrete:
                d = self.net.dist(x)
                a = _sample(d, self.gen)
                return a.numpy(), d.log_prob(a).numpy().astype(np.float32)
            # Categorical(logits=...)'s arithmetic, bit for bit, without building and validating one;
            # sampled with the policy's own generator, so a sampler's actions depend on its seed alone.
            out = self.net.pi(x)
            logits = _log_probs(out)
            a = torch.multinomial(logits.softmax(-1), 1, generator=self.gen)
            return a.squeeze(-1).numpy(), logits.gather(-1, a).squeeze(-1).numpy()

    def greedy(self, obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.net.mode(torch.as_tensor(obs, dtype=torch.float32)).numpy()

    def set_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        load_into(self.net, weights)
        self.version = version


def _log_probs(out: torch.Tensor) -> torch.Tensor:
    """Categorical(logits=out)'s normalised logits, its arithmetic: the one log-probability the
    samplers (the behaviour policy) and the learner both take, so a ratio at no lag is exactly 1."""
    return out - out.logsumexp(-1, keepdim=True)


def _sample(d: torch.distributions.Distribution, gen: torch.Generator) -> torch.Tensor:
    # Sampled with the policy's own generator, so a sampler's actions depend on its seed alone.
    base = d.base_dist
    return base.loc + base.scale * torch.randn(base.loc.shape, generator=gen)


def vtrace(
    values: torch.Tensor, next_values: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor,
    ends: torch.Tensor, rhos: torch.Tensor, cs: torch.Tensor,
) -> torch.Tensor:
    """V-trace targets v_t for segments of shape (segments, steps); see the module docstring.
    ``discounts``: gamma, or 0 after a termination; ``ends``: 1 where an episode ended (terminated
    or truncated) at that step; ``rhos`` and ``cs`` already truncated (cs includes lambda)."""
    deltas = rhos * (rewards + discounts * next_values - values)
    carry = discounts * (1.0 - ends) * cs
    acc = torch.zeros_like(values[:, 0])
    out = torch.empty_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        acc = deltas[:, t] + carry[:, t] * acc
        out[:, t] = values[:, t] + acc
    return out


class PPOLearner:
    """Trains on batches of whole segments; one call of ``learn`` is one weight version."""

    def __init__(
        self, obs_dim: int, actions: int, discrete: bool, spec: PPOSpec, *, gamma: float, total_env_steps: int, seed: int,
    ) -> None:
        torch.manual_seed(seed)
        self.spec = spec
        self.gamma = gamma
        self.total = total_env_steps
        self.net = ActorCritic(obs_dim, actions, discrete, spec.hidden, spec.log_std_init)
        # Fused: one kernel over every parameter instead of a dozen ops per parameter, Adam's arithmetic.
        self.opt = torch.optim.Adam(self.net.parameters(), lr=spec.lr, eps=1e-5, fused=True)
        self.grads = flat_grads(list(self.net.parameters()))
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.updates = 0

    def weights(self) -> dict[str, np.ndarray]:
        return weights_of(self.net)

    def state(self) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
        """(counters, arrays by file stem): all a restarted learner needs to go on as this one would."""
        return {"updates": self.updates}, {"net": weights_of(self.net), "adam": adam_arrays(self.opt),
                                           "gen": generator_state(self.gen)}

    def load_state(self, counters: dict, arrays: dict[str, dict[str, np.ndarray]]) -> None:
        load_into(self.net, arrays["net"])
        load_adam(self.opt, arrays["adam"])
        load_generator(self.gen, arrays["gen"])
        self.updates = int(counters["updates"])

    def learn(self, cols: dict[str, np.ndarray], env_steps: int) -> dict:
        """``ppo.epochs`` passes of minibatch steps over one batch of segments (columns shaped
        (segments, steps, ...)); ``env_steps`` so far sets the annealed lr and clip range."""
        p = self.spec
        frac = max(0.0, 1.0 - env_steps / self.total) if p.anneal else 1.0
        lr, clip = p.lr * frac, p.clip * frac
        for g in self.opt.param_groups:
            g["lr"] = lr
        # Copies: columns from another process arrive as read-only views.
        obs, nxt, act = (torch.tensor(np.asarray(cols[k])) for k in ("obs", "next_obs", "action"))
        rew, term, ends, logp_mu = (torch.tensor(np.asarray(cols[k], dtype=np.float32)) for k in ("reward", "terminated", "ended", "logp"))
        with torch.no_grad():
            logp_prox = self.net.log_prob_entropy(obs, act)[0]
            values, next_values = self.net.value(obs), self.net.value(nxt)
            ratio = (logp_prox - logp_mu).exp()  # the lag's importance weight, reported either way
            if p.lag_correction == "vtrace":
                rhos, cs, logp_old = ratio.clamp(max=p.rho_bar), ratio.clamp(max=p.c_bar), logp_prox
            else:
                rhos = cs = torch.ones_like(ratio)
                logp_old = logp_mu
            targets = vtrace(values, next_values, rew, self.gamma * (1.0 - term), ends, rhos, p.gae_lambda * cs)
            adv = targets - values
        n, m = adv.numel(), p.minibatch
        flat = lambda x: x.reshape(n, -1)  # noqa: E731
        # One tensor of every column a step reads, permuted by one gather per epoch; a minibatch is
        # then a slice of it, and its columns views.
        rows = torch.cat([flat(obs), flat(act).to(obs.dtype), flat(logp_old), flat(adv), flat(targets)], 1)
        d_obs, d_act = flat(obs).shape[1], flat(act).shape[1]
        per_epoch = len(range(0, n - m + 1, m))
        steps = p.epochs * per_epoch
        # Each step's losses and ratios, read out once after the last step.
        losses = torch.empty(steps, 3)
        ratios = torch.empty(steps, m)
        step = 0
        for _ in range(p.epochs):
            shuffled = rows[torch.randperm(n, generator=self.gen)]
            for start in range(0, n - m + 1, m):
                mb = shuffled[start:start + m]
                o, a_mb = mb[:, :d_obs], mb[:, d_obs:d_obs + d_act]
                logp_old_mb, a, target = mb[:, -3], mb[:, -2], mb[:, -1]
                a_mb = a_mb.squeeze(1).long() if self.net.discrete else a_mb
                a = (a - a.mean()) / (a.std() + 1e-8) if m > 1 else a
                logp, ent = self.net.log_prob_entropy(o, a_mb)
                r = (logp - logp_old_mb).exp()
                pg = -torch.min(r * a, r.clamp(1.0 - clip, 1.0 + clip) * a).mean()
                vl = ((self.net.value(o) - target) ** 2).mean()
                ent = ent.mean()
                loss = pg + p.vf_coef * vl
                if p.ent_coef:  # with none, the entropy's gradient is zero: left out of backward
                    loss = loss - p.ent_coef * ent
                self.grads.zero_()
                loss.backward()
                clip_flat_(self.grads, p.grad_clip)
                adam_step(self.opt)
                with torch.no_grad():
                    losses[step] = torch.stack((pg, vl, ent))
                    ratios[step] = r
                step += 1
        figs = {}
        if steps:
            with torch.no_grad():
                figs = dict(zip(("policy_loss", "value_loss", "entropy"), losses.mean(0).tolist()))
                figs["clip_frac"] = float(((ratios - 1.0).abs() > clip).float().mean())
                figs["approx_kl"] = float(((ratios - 1.0) - ratios.log()).mean())
        self.updates += steps
        out = {k: figs.get(k, 0.0) for k in ("policy_loss", "value_loss", "entropy", "clip_frac", "approx_kl")}
        out.update(updates=steps, lr=lr, rho_mean=float(ratio.mean()), rho_truncated=float((ratio > p.rho_bar).float().mean()))
        return out

