"""Who did what when: spans per worker (generate / train / sync), for plots and utilization."""

from __future__ import annotations

from collections import defaultdict

GENERATE, TRAIN, SYNC = "generate", "train", "sync"
SEND = "send"  # the env pipeline: a sampler's chunk on its way into the store, held there by its limit


class Timeline:
    """Append-only spans ``(kind, start, end)`` per worker; adjacent spans of a kind are merged."""

    def __init__(self) -> None:
        self.spans: dict[str, list[list]] = defaultdict(list)

    def add(self, worker: str, kind: str, start: float, end: float) -> None:
        if end <= start:
            return
        rows = self.spans[worker]
        if rows and rows[-1][0] == kind and rows[-1][2] >= start:
            rows[-1][2] = max(rows[-1][2], end)
        else:
            rows.append([kind, start, end])
