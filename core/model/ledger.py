"""Accounting of every sample: produced = trained + dropped (by reason) + in flight.

Counts come from the component that owns each transition (the Rollouter admits, the
Trainer trains, the queue and the Rollouter drop), so a sample that a bug loses shows
up as ``lost`` instead of vanishing.
"""

from __future__ import annotations

import base64
from collections import Counter

from core.model.sample import Group

OVERWRITTEN = "replay_overwritten"  # the drop reason of a group a replay ring overwrote untrained


# Counts a checkpoint written before them does not hold: restored as zero.
ADDED_SINCE = frozenset({"observation_tokens", "offpolicy_tokens"})


class LedgerError(RuntimeError):
    """An accounting rule was broken (a sample trained twice, or trained too stale)."""


class Ledger:
    """``trained`` counts samples trained at least once; ``trainings`` every time one is
    trained, which only a replay stage (``reuse``) makes larger. Staleness and token
    aggregates are per training; lifecycle ones (latency, interrupts) per sample."""

    def __init__(self, max_staleness: int, reuse: bool = False) -> None:
        self.max_staleness = max_staleness
        self.reuse = reuse
        self.produced = 0
        self.requeued = 0  # samples sent to generate again after their worker died
        self.trained = 0
        self.trainings = 0
        self.dropped: Counter[str] = Counter()
        self.wasted_tokens = 0  # response tokens generated for samples that were then dropped
        # Groups a replay ring overwrote before training them: generated in full, so the
        # pipeline bound of what the run did counts them (harness.metrics.bounds).
        self.overwritten_ids: list[int] = []
        self._trained_mask = bytearray()
        # one entry per group training
        self.trained_log: list[tuple[int, int, int]] = []  # (prompt_id, generation version, train version)
        self.group_sizes: list[int] = []
        self.e2e_s: list[float] = []  # one per group, at its first training
        # per training
        self.staleness_sum = 0
        self.staleness_max = 0
        self.token_staleness_sum = 0
        self.offpolicy_tokens = 0  # sampled tokens trained under a newer version than sampled them
        self.response_tokens = 0
        # Of those, what tools or environments wrote into agent episodes: context, not trained.
        self.observation_tokens = 0
        self.prompt_tokens = 0
        self.tokens_sq = 0  # sum over trainings of (prompt + response tokens) squared: attention's cost
        self.reward_sum = 0.0  # over trainings of samples that carry a reward (real engines)
        self.rewarded = 0
        # per sample
        self.interrupted = 0
        self.interrupts = 0
        self.resumes = 0
        self.max_response = 0
        self.step_ends: list[tuple[float, int]] = []  # (time, samples trained so far)

    def admitted(self, group: Group) -> None:
        self.produced += group.size

    def requeue(self, group: Group) -> None:
        self.requeued += group.size

    def dropped_groups(self, groups: list[Group], reason: str) -> None:
        for g in groups:
            self.dropped[reason] += g.size
            self.wasted_tokens += sum(s.n_response for s in g.samples)
            if reason == OVERWRITTEN:
                self.overwritten_ids.append(g.prompt_id)

    def trained_mask(self) -> bytes:
        """One byte per sample uid, 1 where trained: what another process needs to tell which
        of its groups this ledger has trained (``all_trained``)."""
        return bytes(self._trained_mask)

    @staticmethod
    def all_trained(mask: bytes, group: Group) -> bool:
        """Every sample of ``group`` is marked in ``mask`` (``trained_mask``)."""
        lo = group.samples[0].uid
        return lo + group.size <= len(mask) and all(mask[lo : lo + group.size])

    def trained_groups(self, groups: list[Group], version: int, now: float) -> None:
        mask = self._trained_mask
        for g in groups:
            lo = g.samples[0].uid
            hi = lo + g.size
            if hi > len(mask):
                mask.extend(bytes(max(hi - len(mask), len(mask))))
            again = any(mask[lo:hi])
            if again and not self.reuse:
                raise LedgerError(f"prompt {g.prompt_id}: a sample is trained twice")
            stale = version - g.version
            if stale > self.max_staleness:
                raise LedgerError(
                    f"prompt {g.prompt_id}: trained at version {version} from version {g.version}, "
                    f"staler than max_staleness {self.max_staleness}"
                )
            if g.resumes != g.aborts:
                raise LedgerError(f"prompt {g.prompt_id}: interrupted {g.aborts} times but resumed {g.resumes} times")
            n = g.size
            self.trainings += n
            self.staleness_sum += stale * n
            self.staleness_max = max(self.staleness_max, stale)
            self.trained_log.append((g.prompt_id, g.version, version))
            self.group_sizes.append(n)
            # One pass over the samples with the sums in locals: this runs for every sample a
            # simulation trains. Integer sums do not depend on their order; the float reward
            # sum is added in the same order as ever.
            response = prompt = sq = token_stale = observed = offpolicy = 0
            reward_sum, rewarded = self.reward_sum, self.rewarded
            for s in g.samples:
                if not s.finished:
                    raise LedgerError(f"sample {s.uid}: trained before its generation finished")
                r, p = s.n_response, s.n_prompt
                response += r
                prompt += p
                sq += (p + r) ** 2
                if s.reward is not None:
                    reward_sum += s.reward
                    rewarded += 1
                if s.observations:  # staleness is the policy's tokens', not a tool's
                    observed += s.observed
                for v, k in s.sampled_spans() if s.observations else s.version_spans:
                    if v < version:
                        token_stale += (version - v) * k
                        offpolicy += k
            self.response_tokens += response
            self.observation_tokens += observed
            self.prompt_tokens += prompt
            self.tokens_sq += sq
            self.token_staleness_sum += token_stale
            self.offpolicy_tokens += offpolicy
            self.reward_sum, self.rewarded = reward_sum, rewarded
            if again:
                continue
            mask[lo:hi] = b"\x01" * n
            self.trained += n
            self.e2e_s.append(now - g.admitted_at)
            self.resumes += g.resumes
            longest = self.max_response
            for s in g.samples:
                s.trained_at = now
                if s.n_response > longest:
                    longest = s.n_response
                if s.interrupts:
                    self.interrupted += 1
                    self.interrupts += s.interrupts
            self.max_response = longest

    def merge(self, other: "Ledger") -> None:
        """Add the accounting of another part of the same run: the ray runtime keeps one
        ledger beside the Rollouter (admitted, dropped) and one beside the Trainer (trained)."""
        if (other.max_staleness, other.reuse) != (self.max_staleness, self.reuse):
            raise LedgerError("merging ledgers of different runs")
        for name, theirs in vars(other).items():
            mine = getattr(self, name)
            if name in ("max_staleness", "reuse"):
                continue
            if name in ("staleness_max", "max_response"):
                setattr(self, name, max(mine, theirs))
            elif name == "_trained_mask":
                if len(theirs) > len(mine):
                    mine.extend(bytes(len(theirs) - len(mine)))
                for i, flag in enumerate(theirs):
                    if flag:
                        if mine[i] and not self.reuse:
                            raise LedgerError(f"sample {i}: trained in two ledgers")
                        mine[i] = 1
            elif isinstance(mine, Counter):
                mine.update(theirs)
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, name, mine + theirs)
        self.step_ends.sort()

    # The trainer's side of the ledger: what a trainer restored from a checkpoint goes back to.
    TRAINED_FIELDS = (
        "trained", "trainings", "_trained_mask", "trained_log", "group_sizes", "e2e_s", "staleness_sum",
        "staleness_max", "token_staleness_sum", "offpolicy_tokens", "response_tokens", "observation_tokens", "prompt_tokens", "tokens_sq", "reward_sum", "rewarded",
        "interrupted", "interrupts", "resumes", "max_response", "step_ends",
    )

    def state(self, shift_s: float = 0.0) -> dict:
        """Every count, JSON-ready (for a checkpoint), its times moved by ``shift_s`` (onto
        another clock, as ``shift_times`` would, leaving this ledger as it is)."""
        out = {}
        for name, v in vars(self).items():
            if name == "step_ends":
                v = self._step_ends_at(shift_s)
            if name == "_trained_mask":
                v = base64.b64encode(bytes(v)).decode()
            elif isinstance(v, Counter):
                v = dict(v)
            elif isinstance(v, list):
                v = [list(x) if isinstance(x, tuple) else x for x in v]
            out[name] = v
        return out

    def restore(self, state: dict, fields: tuple[str, ...] | None = None) -> None:
        """Take the counts of ``state`` (all of them, or only ``fields``)."""
        for name in fields or tuple(vars(self)):
            if name not in state and name in ADDED_SINCE:
                continue  # a checkpoint written before the field: it keeps its start value
            v = state[name]
            if name == "_trained_mask":
                v = bytearray(base64.b64decode(v))
            elif name == "dropped":
                v = Counter(v)
            elif name == "trained_log":
                v = [tuple(x) for x in v]
            elif name == "step_ends":
                v = [tuple(x) for x in v]
            setattr(self, name, v)

    def shift_times(self, dt: float) -> None:
        """Move this ledger's timestamps by ``dt`` (onto another process's clock)."""
        self.step_ends = self._step_ends_at(dt)

    def _step_ends_at(self, dt: float) -> list:
        """The ledger's only times, moved by ``dt``: what ``state`` and ``shift_times`` both move."""
        return [(t + dt, n) for t, n in self.step_ends]

    def step_done(self, now: float) -> None:
        self.step_ends.append((now, self.trainings))

    # Units counted whole, not as groups of samples: an env run's chunks (core/env/chunk_intake.py).
    def admitted_n(self, n: int) -> None:
        self.produced += n

    def trained_n(self, n: int) -> None:
        self.trained += n
        self.trainings += n

    def dropped_n(self, n: int, reason: str) -> None:
        if n:
            self.dropped[reason] += n

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())
