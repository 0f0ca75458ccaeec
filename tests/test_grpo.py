"""The torch GRPO trainer (core/real/grpo.py): the loss's parts one by one, weight export, and that
the tiny model really learns the task on two CPU cores."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from core.model.config import LearnSpec, TaskSpec
from core.api import Batch
from core.real.grpo import TorchTrainBackend, group_advantages, peak_flops, second_moment_mask
from core.real.reward import task_from
from core.model.sample import Group, Sample
from core.real.task import Task

THREADS = 2


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir  # the session's: the same deterministic build, made once


def make_task(model_dir: Path, spec: TaskSpec = TaskSpec(), seed: int = 0) -> Task:
    return task_from(spec, seed, model_dir)


@torch.no_grad()
def sample_groups(
    model, task: Task, prompt_ids: list[int], n: int, max_len: int, temperature: float, version: int = 0
) -> list[Group]:
    """n responses per prompt from ``model``, with behaviour log-probs at ``temperature``, scored.

    A plain KV-cache decode loop over a left-padded batch: everything that differs between
    sequences is in the attention mask and the explicit position ids.
    """
    old_threads = torch.get_num_threads()
    # Decode GEMMs are tiny: one thread is faster, and far faster when the cores are shared.
    torch.set_num_threads(1)
    try:
        return _sample_groups(model, task, prompt_ids, n, max_len, temperature, version)
    finally:
        torch.set_num_threads(old_threads)


def _sample_groups(model, task: Task, prompt_ids: list[int], n: int, max_len: int, temperature: float, version: int) -> list[Group]:
    from transformers import DynamicCache

    cfg = model.config
    eos, pad = cfg.eos_token_id, cfg.pad_token_id
    prompts = [task.tokens(p) for p in prompt_ids for _ in range(n)]
    B, P = len(prompts), max(len(x) for x in prompts)
    ids = torch.full((B, P), pad, dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for i, x in enumerate(prompts):
        ids[i, P - len(x) :] = torch.from_numpy(x)
        mask[i, P - len(x) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    logits = out.logits[:, -1]
    next_pos = pos[:, -1] + 1
    tokens = torch.full((B, max_len), pad, dtype=torch.long)
    logps = torch.zeros((B, max_len))
    done = torch.zeros(B, dtype=torch.bool)
    length = torch.zeros(B, dtype=torch.long)
    for t in range(max_len):
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        tok = torch.multinomial(lp.exp(), 1).squeeze(-1)
        tok = torch.where(done, torch.full_like(tok, pad), tok)
        tokens[:, t] = tok
        logps[:, t] = lp.gather(-1, tok[:, None]).squeeze(-1)
        length += (~done).long()
        done |= tok == eos
        if bool(done.all()) or t == max_len - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=-1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None], past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    groups, uid = [], 0
    for gi, pid in enumerate(prompt_ids):
        samples = []
        for j in range(n):
            i = gi * n + j
            L = int(length[i])
            resp = tokens[i, :L].tolist()
            s = Sample(uid=uid, prompt_id=pid, index=j, n_prompt=len(prompts[i]), prompt_tokens=prompts[i])
            s.add_tokens(L, version, resp, logps[i, :L].tolist())
            s.finished = bool(resp) and resp[-1] == eos
            s.reward = task.reward(pid, resp)
            samples.append(s)
            uid += 1
        groups.append(Group(prompt_id=pid, samples=samples, version=version, admitted_at=0.0))
    return groups


def train_loop(
    model_dir: Path, learn: LearnSpec, steps: int, groups: int, n: int, max_len: int, seed: int = 0, temperature: float = 1.0, threads: int = THREADS
):
    """Sample from the trainer's own weights, train on it; (per-step metrics, wall seconds)."""
    torch.manual_seed(seed)
    backend = TorchTrainBackend(model_dir, learn, threads=threads, seed=seed, temperature=temperature)
    task = make_task(model_dir, seed=seed)
    hist = []
    t0 = time.perf_counter()
    for step in range(steps):
        backend.model.eval()
        batch = sample_groups(backend.model, task, list(range(step * groups, (step + 1) * groups)), n, max_len, temperature, step)
        backend.model.train()
        hist.append(asyncio.run(backend.train_step(Batch(batch), step)))
    return backend, hist, time.perf_counter() - t0


def _sample(prompt: list[int], response: list[int], logprobs: list[float], reward: float, uid: int = 0) -> Sample:
    s = Sample(uid=uid, prompt_id=0, index=uid, n_prompt=len(prompt), prompt_tokens=np.asarray(prompt, dtype=np.int64))
    s.add_tokens(len(response), 0, response, logprobs)
    s.reward, s.finished = reward, True
    return s


def _onpolicy_groups(backend: TorchTrainBackend, model_dir: Path, n_groups: int = 2, n: int = 4, max_len: int = 12, seed: int = 1):
    torch.manual_seed(seed)
    backend.model.eval()
    gs = sample_groups(backend.model, make_task(model_dir), list(range(n_groups)), n, max_len, backend.temperature)
    backend.model.train()
    rng = np.random.default_rng(seed)
    for g in gs:  # the untrained model rarely earns a reward; give the groups spread
        for s in g.samples:
            s.reward = float(rng.random())
    return gs


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def test_group_advantages_normalized():
    a = group_advantages(np.array([0.0, 1.0, 0.0, 1.0]))
    assert a.mean() == pytest.approx(0.0, abs=1e-6)
    assert a.std() == pytest.approx(1.0, abs=1e-4)
    assert np.all(group_advantages(np.full(8, 0.1)) == 0.0)


def test_zero_spread_group_gives_zero_gradient(model_dir):
    b = TorchTrainBackend(model_dir, LearnSpec(), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir)
    for s in gs[0].samples:
        s.reward = 0.3
    g0 = _flat(b.gradient(Batch([gs[0]])))
    assert torch.count_nonzero(g0) == 0
    # ...and a zero-spread group changes nothing about the other group's gradient.
    g1, both = _flat(b.gradient(Batch([gs[1]]))), _flat(b.gradient(Batch(gs)))
    assert torch.dot(g1, both) / (g1.norm() * both.norm()) > 0.9999
    before = b.weights()
    m = asyncio.run(b.train_step(Batch([gs[0]]), 0))
    assert m["updates"] == 0
    after = b.weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_batch_importance_weights_scale_each_groups_part_of_the_gradient(model_dir):
    # A prioritized replay draw's importance weights reach the loss through the Batch.
    b = TorchTrainBackend(model_dir, LearnSpec(), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir)
    g0, g1 = _flat(b.gradient(Batch([gs[0]]))), _flat(b.gradient(Batch([gs[1]])))
    assert g0.norm() > 0 and g1.norm() > 0
    # The loss is a token mean over the batch: each group's part is its gradient, weighted.
    plain = _flat(b.gradient(Batch(gs)))
    weighted = _flat(b.gradient(Batch(gs, np.array([0.0, 3.0]))))
    ones = _flat(b.gradient(Batch(gs, np.ones(2))))
    assert torch.allclose(ones, plain, atol=1e-7)
    n0, n1 = (sum(len(s.response_tokens) for s in g.samples) for g in gs)
    expected = 3.0 * g1 * n1 / (n0 + n1)
    assert torch.allclose(weighted, expected, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(weighted, plain, rtol=1e-3)


def test_step_reports_staleness_per_token_of_responses_that_span_versions(model_dir):
    b = TorchTrainBackend(model_dir, LearnSpec(minibatches=1), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir)
    total = lagged = 0
    for g in gs:
        for s in g.samples:
            n = len(s.response_tokens)
            k = n // 2
            s.version_spans = [[0, k], [2, n - k]] if k else [[2, n]]
            total += n
            lagged += 3 * k + (n - k)
    m = asyncio.run(b.train_step(Batch(gs), 3))
    assert m["token_staleness_mean"] == pytest.approx(lagged / total)
    assert m["token_staleness_max"] == (3 if any(len(s.response_tokens) > 1 for g in gs for s in g.samples) else 1)


def test_what_a_tool_wrote_into_an_episode_is_context_and_never_trained(model_dir):
    """Observation tokens (an agent episode's tool answers) are read by the model as context
    but take no part in the loss: their behaviour log-probs change nothing, the same tokens
    sampled by the policy would, and the step counts them apart."""
    b = TorchTrainBackend(model_dir, LearnSpec(minibatches=1), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir, max_len=16)
    for g in gs:
        for s in g.samples:
            n = len(s.response_tokens)
            if n >= 6:  # tokens 2..4 become a tool's answer, as add_observation writes it
                lp = s.logprobs.copy()
                lp[2:5] = 0.0
                s.logprobs, s.observations = lp, [[2, 3]]
    observed = sum(s.observed for g in gs for s in g.samples)
    assert observed > 0
    masked = _flat(b.gradient(Batch(gs)))
    for g in gs:
        for s in g.samples:
            for start, k in s.observations:
                lp = s.logprobs.copy()
                lp[start : start + k] = -7.0
                s.logprobs = lp
    assert torch.equal(_flat(b.gradient(Batch(gs))), masked)
    kept = {id(s): s.observations for g in gs for s in g.samples}
    for g in gs:
        for s in g.samples:
            s.observations = ()
    assert not torch.allclose(_flat(b.gradient(Batch(gs))), masked)
    for g in gs:
        for s in g.samples:
            s.observations = kept[id(s)]
    m = asyncio.run(b.train_step(Batch(gs), 0))
    total = sum(len(s.response_tokens) for g in gs for s in g.samples)
    assert m["observation_tokens"] == observed and m["response_tokens"] == total - observed


def test_is_weight_truncated_at_cap(model_dir):
    cap = 1.5
    b = TorchTrainBackend(model_dir, LearnSpec(is_cap=cap), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir)
    # Behaviour log-probs far below the trainer's: every ratio is e^5 before truncation.
    for g in gs:
        for s in g.samples:
            s.logprobs = [x - 5.0 for x in s.logprobs]
    m = asyncio.run(b.train_step(Batch(gs), 0))
    assert m["is_truncated_frac"] == pytest.approx(1.0)
    assert m["is_weight_mean"] == pytest.approx(cap)
    # On-policy the weights are 1 and none is truncated.
    b2 = TorchTrainBackend(model_dir, LearnSpec(is_cap=cap, minibatches=1), threads=THREADS)
    m2 = asyncio.run(b2.train_step(Batch(_onpolicy_groups(b2, model_dir)), 0))
    assert m2["is_truncated_frac"] == 0.0
    assert m2["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("correction", ["decoupled", "bypass"])
def test_behaviour_kl_is_zero_on_policy_and_the_k3_of_a_known_shift(model_dir, correction):
    b = TorchTrainBackend(model_dir, LearnSpec(correction=correction, minibatches=1), threads=THREADS)
    assert asyncio.run(b.train_step(Batch(_onpolicy_groups(b, model_dir)), 0))["behaviour_kl"] == pytest.approx(0.0, abs=1e-5)
    # Behaviour log-probs 0.5 above the policy's on every token: r = e^-0.5, KL = r - 1 - log r.
    b2 = TorchTrainBackend(model_dir, LearnSpec(correction=correction, minibatches=1), threads=THREADS)
    gs = _onpolicy_groups(b2, model_dir)
    for g in gs:
        for s in g.samples:
            s.logprobs = [x + 0.5 for x in s.logprobs]
    m = asyncio.run(b2.train_step(Batch(gs), 0))
    assert m["behaviour_kl"] == pytest.approx(np.exp(-0.5) - 1.0 + 0.5, rel=1e-3)


def test_icepop_drops_tokens_far_off_policy_and_keeps_the_rest(model_dir):
    cap = 1.5
    b = TorchTrainBackend(model_dir, LearnSpec(is_cap=cap, correction="icepop", minibatches=1), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir)
    on = _flat(b.gradient(Batch(gs)))
    # The first group's behaviour log-probs far below the trainer's: its tokens leave [1/cap, cap].
    for s in gs[0].samples:
        s.logprobs = [x - 5.0 for x in s.logprobs]
    only_second = _flat(b.gradient(Batch(gs)))
    n0, n1 = (sum(len(s.response_tokens) for s in g.samples) for g in gs)
    second = _flat(b.gradient(Batch(gs[1:])))
    # Dropped, not truncated: the gradient is the second group's alone, over all tokens.
    assert torch.allclose(only_second, second * n1 / (n0 + n1), rtol=1e-3, atol=1e-6)
    assert not torch.allclose(only_second, on, rtol=1e-2)
    m = asyncio.run(b.train_step(Batch(gs), 0))
    assert m["masked_frac"] == pytest.approx(n0 / (n0 + n1))
    # TIS keeps them, at the cap.
    t = TorchTrainBackend(model_dir, LearnSpec(is_cap=cap, correction="tis", minibatches=1), threads=THREADS)
    assert asyncio.run(t.train_step(Batch(gs), 0))["masked_frac"] == 0.0


def test_second_moment_mask_drops_the_fewest_outliers_that_bring_the_mean_under_the_threshold():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    log_w = torch.tensor([[0.1, -0.6, 0.2, 9.0], [-0.3, 0.0, 5.0, 0.0]])  # 9 and 5 are padding
    # Squares 0.01, 0.36, 0.04, 0.09, 0: running means of the ascending ones 0, 0.005, 0.0167, 0.035, 0.1.
    kept = second_moment_mask(log_w, mask, 0.04)
    assert kept.tolist() == [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert second_moment_mask(log_w, mask, 1.0).tolist() == mask.tolist()
    rng = np.random.default_rng(0)
    for _ in range(20):
        lw = torch.from_numpy(rng.normal(0, rng.uniform(0.05, 1.0), (4, 30)).astype(np.float32))
        m = torch.from_numpy((rng.random((4, 30)) < 0.8).astype(np.float32))
        k = second_moment_mask(lw, m, 0.04)
        assert bool((k <= m).all())
        sq = lw[k > 0] ** 2
        assert sq.numel() == 0 or float(sq.mean()) <= 0.04 + 1e-6
        # Fewest dropped: putting back the smallest dropped token breaks the bound.
        dropped = (lw ** 2)[(m > 0) & (k == 0)]
        if dropped.numel():
            assert float(torch.cat([sq, dropped.min().reshape(1)]).mean()) > 0.04


@pytest.mark.parametrize("correction", ["bypass", "decoupled", "icepop", "seq_tis", "seq_mis", "m2po"])
def test_every_correction_is_the_policy_gradient_on_policy(model_dir, correction):
    # On policy every weight is 1 and no ratio is clipped: each correction's gradient is TIS's.
    b = TorchTrainBackend(model_dir, LearnSpec(correction="decoupled", minibatches=1), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir)
    plain, dec = _flat(b.gradient(Batch(gs), correction="tis")), _flat(b.gradient(Batch(gs), correction=correction))
    assert plain.norm() > 0
    cos = torch.dot(plain, dec) / (plain.norm() * dec.norm())
    assert cos > 0.999
    assert torch.allclose(plain, dec, rtol=1e-3, atol=1e-6)


def test_decoupled_counts_its_recompute_pass(model_dir):
    b = TorchTrainBackend(model_dir, LearnSpec(correction="decoupled", minibatches=1), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir)
    m = asyncio.run(b.train_step(Batch(gs), 0))
    assert np.isfinite(m["loss"]) and m["clip_frac"] == 0.0 and m["updates"] == 1
    # The recompute pass is counted: 4 passes instead of 3.
    p = TorchTrainBackend(model_dir, LearnSpec(correction="tis", minibatches=1), threads=THREADS)
    mp = asyncio.run(p.train_step(Batch(gs), 0))
    assert m["flops"] == pytest.approx(mp["flops"] * 4 / 3)


def test_minibatches_make_several_updates(model_dir):
    b = TorchTrainBackend(model_dir, LearnSpec(minibatches=2, correction="decoupled"), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir, n_groups=4)
    m = asyncio.run(b.train_step(Batch(gs), 0))
    assert m["updates"] == 2
    assert b.compute_s > 0 and b.flops == m["flops"] and b.params > 0


def test_weights_round_trip(model_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file
    from transformers import Qwen2ForCausalLM

    b = TorchTrainBackend(model_dir, LearnSpec(), threads=THREADS)
    asyncio.run(b.train_step(Batch(_onpolicy_groups(b, model_dir)), 0))
    w = b.weights()
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        assert set(w) == set(f.keys())  # the names save_pretrained writes, tied lm_head once
    assert all(v.dtype == np.float32 for v in w.values())
    # The copies are detached from the live weights.
    w0 = {k: v.copy() for k, v in w.items()}
    asyncio.run(b.train_step(Batch(_onpolicy_groups(b, model_dir, seed=2)), 1))
    assert all(np.array_equal(w0[k], w[k]) for k in w)

    other = TorchTrainBackend(model_dir, LearnSpec(), threads=THREADS)
    other.load_weights(w)
    assert all(np.array_equal(other.weights()[k], w[k]) for k in w)
    with pytest.raises(KeyError):
        other.load_weights({k: v for k, v in w.items() if k != "model.norm.weight"})

    out = tmp_path / "exported"
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = Qwen2ForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for k, v in hf.named_parameters():
        assert np.array_equal(v.detach().numpy(), w[k]), k
    assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)


def test_train_step_does_not_block_event_loop(model_dir):
    b = TorchTrainBackend(model_dir, LearnSpec(), threads=THREADS)
    gs = _onpolicy_groups(b, model_dir, n_groups=8, n=8, max_len=64)

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        ticks_before = ticks
        m = await b.train_step(Batch(gs), 0)
        during = ticks - ticks_before
        stop.set()
        await t
        return m, during

    m, during = asyncio.run(main())
    assert m["compute_s"] > 0.02
    assert during >= 5


def test_peak_flops_is_measured():
    t0 = time.perf_counter()
    f = peak_flops(THREADS, "cpu")
    assert time.perf_counter() - t0 < 2.0
    assert 1e8 < f < 1e14


def test_learns_the_task(model_dir):
    """Reward rises clearly within 20 on-policy steps (fixed seeds, ~24 s on 2 idle cores)."""
    backend, hist, wall = train_loop(model_dir, LearnSpec(), steps=STEPS, groups=GROUPS, n=N, max_len=MAX_LEN)
    r = [h["reward_mean"] for h in hist]
    first, last = np.mean(r[:5]), np.mean(r[-10:])
    assert last > 1.5 * first and last > first + 0.04, (first, last, r, wall)
    assert backend.compute_s > 0 and backend.flops > 0
    assert all(h["updates"] >= 1 for h in hist)


# 8 groups of 8, the batch the defaults were tuned on. 20 steps: measured, the mean reward of the
# last 10 is 2.5x that of the first 5 (0.169 against 0.067, the same on both backends; at 30
# steps 4.0x, at 50 7.2x), where the test asks for 1.5x and +0.04. The later steps are the
# longer ones (longer responses): 20 steps take two thirds of 30's time (24 s against 36 s).
STEPS, GROUPS, N, MAX_LEN = 20, 8, 8, 96
