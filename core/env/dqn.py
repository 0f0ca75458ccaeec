"""Double DQN on n-step rows with prioritized replay: the off-policy learner of the env pipeline,
and the epsilon-greedy policy its samplers act with.

Per row i of a minibatch (rows from ``EnvSampler``: reward already the n-step sum, discount
g^k or 0):

    a*_i  = argmax_a Q_online(next_obs_i, a)                 double DQN: the online net picks,
    y_i   = reward_i + discount_i * Q_target(next_obs_i, a*_i)   the target net values
    td_i  = y_i - Q_online(obs_i, action_i)
    loss  = mean_i( w_i * huber(td_i) )                      w_i: the replay's importance weight

and |td_i| goes back to the replay as the row's new priority (Schaul et al. 2016). The target
net copies the online one every ``target_every`` updates.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from core.env.net_state import adam_arrays, adam_step, clip_flat_, flat_grads, load_adam, load_into, weights_of

# A row with no TD error is still drawn now and then (PER's epsilon).
MIN_PRIORITY = 1e-3


class QNetwork(nn.Module):
    """An MLP from an observation vector to one value per action."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = obs_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, n_actions))
        self.net = nn.Sequential(*layers)
        # Kept: slicing a Sequential builds a new Module, which cost as much as a layer.
        self._linears = tuple(m for m in layers if isinstance(m, nn.Linear))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.outputs(obs)[-1]

    def outputs(self, obs: torch.Tensor) -> list[torch.Tensor]:
        """obs and every layer's output (after its ReLU; the last is the Q-values): what
        ``backward_into`` reads. ``self.net``'s layers, called as ops rather than as modules,
        whose calls cost as much as a layer's matmul here."""
        outs = [obs]
        linears = self._linears
        for i, lin in enumerate(linears):
            h = torch.addmm(lin.bias, outs[-1], lin.weight.t())
            outs.append(h.relu_() if i < len(linears) - 1 else h)
        return outs

    def backward_into(self, outs: list[torch.Tensor], d_q: torch.Tensor) -> None:
        """Write into each parameter's ``.grad`` the gradient of a loss whose gradient at the
        Q-values (``outs[-1]``) is ``d_q``: autograd's arithmetic for Linear and ReLU, op for op
        (tests/test_env_dqn.py checks the weights against autograd's), without its graph and
        engine, which cost more than the matmuls at these sizes. Overwrites the grads."""
        linears = self._linears
        d = d_q
        for i in range(len(linears) - 1, -1, -1):
            lin = linears[i]
            if i < len(linears) - 1:
                d = d.mul_(outs[i + 1] > 0)  # ReLU's gradient: through where its output is positive
            torch.mm(d.t(), outs[i], out=lin.weight.grad)
            torch.sum(d, 0, out=lin.bias.grad)
            if i:
                d = torch.mm(d, lin.weight)


def _tensor(a: np.ndarray) -> torch.Tensor:
    # A batch from the replay actor arrives as read-only views of the object store: copied. One
    # sampled in this process is the caller's to give: shared.
    return torch.from_numpy(a) if a.flags.writeable else torch.tensor(a)


class EpsilonGreedy:
    """Acts greedily on a copy of the learner's Q-network, at random with probability epsilon;
    epsilon falls linearly from ``eps_start`` to ``eps_end`` over ``eps_decay_steps`` env steps."""

    def __init__(
        self, obs_dim: int, n_actions: int, hidden: tuple[int, ...], *,
        eps_start: float, eps_end: float, eps_decay_steps: int, seed: int,
    ) -> None:
        if not 0.0 <= eps_end <= eps_start <= 1.0:
            raise ValueError(f"eps_start={eps_start}, eps_end={eps_end}: need 0 <= eps_end <= eps_start <= 1")
        self.net = QNetwork(obs_dim, n_actions, hidden)
        self.n_actions = n_actions
        self.eps_start, self.eps_end, self.eps_decay_steps = eps_start, eps_end, max(1, eps_decay_steps)
        self.rng = np.random.default_rng(seed)
        self.version = 0

    def epsilon(self, env_steps: int) -> float:
        frac = min(1.0, env_steps / self.eps_decay_steps)
        return self.eps_start + frac * (self.eps_end - self.eps_start)

    def greedy(self, obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.net(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy().astype(np.int64)

    def act(self, obs: np.ndarray, env_steps: int) -> tuple[np.ndarray, np.ndarray]:
        eps = self.epsilon(env_steps)
        best = self.greedy(obs)
        explore = self.rng.random(len(obs)) < eps
        actions = np.where(explore, self.rng.integers(0, self.n_actions, len(obs)), best)
        # The behaviour policy's probability of the action it took.
        p_best = 1.0 - eps + eps / self.n_actions
        logp = np.where(actions == best, math.log(p_best), math.log(eps / self.n_actions) if eps > 0 else -np.inf)
        return actions, logp.astype(np.float32)

    def set_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        load_into(self.net, weights)
        self.version = version


class DQNLearner:
    def __init__(
        self, obs_dim: int, n_actions: int, hidden: tuple[int, ...], *,
        lr: float, target_every: int, grad_clip: float, seed: int,
    ) -> None:
        torch.manual_seed(seed)
        self.online = QNetwork(obs_dim, n_actions, hidden)
        self.target = QNetwork(obs_dim, n_actions, hidden)
        self.target.load_state_dict(self.online.state_dict())
        # Fused: one kernel over every parameter instead of a dozen ops per parameter, Adam's arithmetic.
        self.opt = torch.optim.Adam(self.online.parameters(), lr=lr, fused=True)
        self.grads = flat_grads(list(self.online.parameters()))  # written by QNetwork.backward_into
        self.target_every = target_every
        self.grad_clip = grad_clip
        self.updates = 0

    def weights(self) -> dict[str, np.ndarray]:
        return weights_of(self.online)

    def state(self) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
        """(counters, arrays by file stem): all a restarted learner needs to go on as this one would."""
        return {"updates": self.updates}, {"online": weights_of(self.online), "target": weights_of(self.target),
                                           "adam": adam_arrays(self.opt)}

    def load_state(self, counters: dict, arrays: dict[str, dict[str, np.ndarray]]) -> None:
        load_into(self.online, arrays["online"])
        load_into(self.target, arrays["target"])
        load_adam(self.opt, arrays["adam"])
        self.updates = int(counters["updates"])

    def update(self, batch: dict[str, np.ndarray], weights: np.ndarray) -> tuple[np.ndarray, dict]:
        """One Adam step on a minibatch; returns the rows' new priorities and the step's figures."""
        obs, nxt, act, rew, disc = (_tensor(batch[k]) for k in ("obs", "next_obs", "action", "reward", "discount"))
        w = _tensor(np.asarray(weights, dtype=np.float32))
        with torch.no_grad():
            outs = self.online.outputs(obs)
            q = outs[-1].gather(1, act[:, None]).squeeze(1)
            best = self.online(nxt).argmax(1, keepdim=True)
            y = rew + disc * self.target(nxt).gather(1, best).squeeze(1)
            td = y - q
            loss = (w * nn.functional.smooth_l1_loss(q, y, reduction="none")).mean()
            # The loss's gradient at q: the mean's 1/n, the weight, smooth L1's slope (beta 1) clipped at +-1.
            dq = (w / len(w)) * (q - y).clamp(-1.0, 1.0)
            self.online.backward_into(outs, torch.zeros_like(outs[-1]).scatter_(1, act[:, None], dq[:, None]))
        norm = clip_flat_(self.grads, self.grad_clip)
        adam_step(self.opt)
        self.updates += 1
        if self.updates % self.target_every == 0:
            self.target.load_state_dict(self.online.state_dict())
        prio = td.abs_().numpy().astype(np.float64) + MIN_PRIORITY
        return prio, {"loss": float(loss.detach()), "q_mean": float(q.detach().mean()), "grad_norm": float(norm)}
