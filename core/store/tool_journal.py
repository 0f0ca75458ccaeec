"""Tool calls' results, written ahead: each result is appended here as the ``ToolBox`` records
it, before the model reads it. A run rolled back to a checkpoint (``--resume``, a rollout actor
restarted) generates again what came after; a call it makes again is answered from here, not
made twice. A checkpoint keeps how many records the journal held (``records``): what follows
is what the checkpoint does not know.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.store.checkpoint import CheckpointError
from core.store.journal_file import JournalFile

KIND = "asyncrl.tool-result/1"
FIELDS = {"id", "name", "content", "error", "seconds"}  # core/agent/tools.py ToolResult


class ToolJournal:
    def __init__(self, path: Path) -> None:
        self.file = JournalFile(path)
        self.records = sum(1 for _ in self.file.read())  # a resumed run appends to its journal

    def recorded(self, result: dict) -> None:
        """A call's result (``ToolResult`` fields)."""
        self.file.append(json.dumps({"kind": KIND, **result}).encode())
        self.records += 1

    def since(self, n: int) -> list[dict]:
        """The results recorded after the first ``n``."""
        out = []
        for i, (at, body) in enumerate(self.file.read()):
            if i < n:
                continue
            try:
                rec = json.loads(bytes(body))
                if not isinstance(rec, dict) or rec.pop("kind", None) != KIND or set(rec) != FIELDS:
                    raise ValueError("not a tool result")
            except ValueError as exc:
                raise CheckpointError(str(self.file.path), f"tool result unreadable ({exc})", "start the run again", at) from None
            out.append(rec)
        return out

    def close(self) -> None:
        self.file.close()
