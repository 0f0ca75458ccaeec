"""What a real engine counts, the same way for torch and vLLM: busy time, the running batch
integrated over time, tokens, and the GENERATE spans of the timeline."""

from __future__ import annotations

from typing import Optional, Sized

from core.api import Engine
from core.model.sample import Sample, logprob_array, token_array
from core.model.timeline import GENERATE, Timeline


class EngineMeter(Engine):
    """Base of the real engines. ``self._live`` (any sized container) holds the requests
    submitted and not yet finished or aborted; busy means it is not empty."""

    name: str
    timeline: Optional[Timeline]
    _live: Sized

    def _init_meter(self) -> None:
        self.tokens_generated = 0
        self.prefill_tokens = 0
        self.busy_s = 0.0
        self.seq_s = 0.0
        self._t = 0.0  # time the counters were last advanced to
        self._busy_since: Optional[float] = None
        # Held while frozen (inflight weight sync): requests stay live but nothing runs, so
        # neither busy time nor the running batch accrue.
        self._held = False
        # For calibration (harness/calibrate.py): one row per engine step, appended as it ends.
        self.decode_steps: list[tuple[int, int, float]] = []  # (running, context tokens held, seconds)
        self.prefills: list[tuple[int, float]] = []  # (tokens prefilled, seconds)

    def _advance(self, now: float) -> None:
        if self._live and not self._held and now > self._t:
            self.seq_s += len(self._live) * (now - self._t)
        self._t = max(self._t, now)

    def _busy(self, now: float) -> None:
        if self._busy_since is None and not self._held:
            self._busy_since = now

    def _close_span(self, now: float) -> None:
        self.busy_s += now - self._busy_since
        if self.timeline is not None:
            self.timeline.add(self.name, GENERATE, self._busy_since, now)
        self._busy_since = None

    def _meter_freeze(self, now: float) -> None:
        self._advance(now)
        self._held = True
        if self._busy_since is not None:
            self._close_span(now)

    def _meter_thaw(self, now: float) -> None:
        self._advance(now)  # only moves the clock: the frozen time is not counted
        self._held = False
        if self._live:
            self._busy(now)

    def _idle(self, now: float) -> None:
        if self._busy_since is not None and not self._live:
            self._close_span(now)

    def _deliver(
        self,
        sample: Sample,
        tokens,
        logprobs,
        finished: bool,
        now: float,
        cuts: Optional[list[tuple[int, int]]] = None,
    ) -> None:
        """Hand a request's tokens (all it produced since it was submitted: arrays, or the
        engine's own lists, made arrays here once) to its sample.

        ``cuts``: ``(first token, version)`` of each run of tokens, where the weights changed
        under the request (inflight); None: every token is of the current version."""
        if len(tokens):
            tokens, logprobs = token_array(tokens), logprob_array(logprobs)
            runs = cuts or [(0, self.version)]
            ends = [start for start, _ in runs[1:]] + [len(tokens)]
            for (start, version), end in zip(runs, ends):
                sample.add_tokens(end - start, version, tokens[start:end], logprobs[start:end])
            self.tokens_generated += len(tokens)
        if finished:
            sample.finished = True
            sample.finished_at = now

    def step_spans(self) -> dict:
        """What calibration fits the decode and prefill costs to."""
        return {"decode": self.decode_steps, "prefill": self.prefills}

    def state(self) -> dict:
        """The counters, for a whole-run checkpoint (taken while rollout is paused)."""
        return {"tokens_generated": self.tokens_generated, "prefill_tokens": self.prefill_tokens, "busy_s": self.busy_s, "seq_s": self.seq_s}

    def restore(self, st: dict) -> None:
        self.tokens_generated, self.prefill_tokens = st["tokens_generated"], st["prefill_tokens"]
        self.busy_s, self.seq_s = st["busy_s"], st["seq_s"]
