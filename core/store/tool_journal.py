"""Tool calls' results, written ahead: each result is appended here as the ``ToolBox`` records
it, before the model reads it. A run rolled back to a checkpoint (``--resume``, a rollout actor
restarted) generates again what came after; a call it makes again is answered from here, not
made twice. A checkpoint keeps how many records the journal held (``records``) and a digest of
them: what follows is what the checkpoint does not know, and a journal that no longer starts
with what it knew (deleted, rewritten, cut short) is refused before a resume runs (``check``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Optional

from core.store.checkpoint import CheckpointError
from core.store.journal_file import JournalFile, frames, open_regular

NAME = "tools.journal"  # in a durable run's mode directory, beside the queue's journal
KIND = "asyncrl.tool-result/1"
FIELDS = {"id", "name", "content", "error", "seconds"}  # core/agent/tools.py ToolResult
# What a failed call's ``error`` names (core/agent/tools.py reads them from here).
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "not_text", "too_long")
CALL_ID = re.compile(r"\d{1,12}:\d{1,6}:\d{1,6}:[0-9a-f]{12}")  # core/agent/tool_call.py call_id
MAX_RECORD_BYTES = 1 << 17  # 4,096 characters of content, each at most 6 bytes as JSON, and the rest
FIX = "put back the tools.journal the run wrote, or start the run again"


class ToolJournal:
    def __init__(self, path: Path) -> None:
        self.file = JournalFile(path)
        self._digest = hashlib.blake2b(digest_size=16)
        self.records = 0
        for _, body in self.file.read():  # a resumed run appends to its journal
            self._digest.update(body)
            self.records += 1

    @property
    def digest(self) -> str:
        """Of the records so far, for a checkpoint (``check``)."""
        return self._digest.hexdigest()

    def recorded(self, result: dict) -> None:
        """A call's result (``ToolResult`` fields)."""
        body = json.dumps({"kind": KIND, **result}).encode()
        self.file.append(body)
        self._digest.update(body)
        self.records += 1

    def since(self, n: int) -> list[dict]:
        """The results recorded after the first ``n``."""
        return [rec for i, (at, body) in enumerate(self.file.read()) if i >= n and (rec := _record(body, self.file.path, at))]

    def close(self) -> None:
        self.file.close()


def _record(body: memoryview, path: Path, at: int) -> dict:
    """A record's result, checked whole: any other body is a ``CheckpointError``."""
    why = None
    try:
        rec = json.loads(bytes(body)) if len(body) <= MAX_RECORD_BYTES else None
    except ValueError as exc:
        rec, why = None, f"not JSON: {str(exc)[:80]}"
    if not isinstance(rec, dict):
        why = why or (f"a record of {len(body)} bytes, more than {MAX_RECORD_BYTES}" if len(body) > MAX_RECORD_BYTES else "not a JSON object")
    elif rec.get("kind") != KIND:
        why = f"kind {str(rec.get('kind'))[:60]!r}, not {KIND!r}"
    elif set(rec) - {"kind"} != FIELDS:
        why = f"fields {sorted(set(rec) - {'kind'})[:8]}, not {sorted(FIELDS)}"
    elif not isinstance(rec["id"], str) or not CALL_ID.fullmatch(rec["id"]):
        why = f"call id {str(rec['id'])[:60]!r} is not one asyncrl makes (episode:turn:index:digest)"
    elif not isinstance(rec["name"], str) or not isinstance(rec["content"], str) or (rec["error"] is not None and rec["error"] not in ERROR_KINDS):
        why = "a name, content or error kind of the wrong type"
    elif isinstance(rec["seconds"], bool) or not isinstance(rec["seconds"], (int, float)) or not math.isfinite(rec["seconds"]) or rec["seconds"] < 0:
        why = "seconds is not a finite number >= 0"
    if why is not None:
        raise CheckpointError(str(path), f"tool result unreadable ({why})", FIX, at)
    rec.pop("kind")
    return rec


def check(path: Path, records: int, digest: Optional[str]) -> None:
    """The journal a resume will append to and answer from, before anything runs: a regular file
    of the run (never through a link), every record a tool result, and at least the ``records``
    the checkpoint counted, which hash to its ``digest`` (None: a checkpoint written before it
    kept one). ``CheckpointError`` names what is wrong."""
    if not os.path.lexists(path):
        if records:
            raise CheckpointError(str(path), f"is missing, and the checkpoint counted {records} tool results in it", FIX)
        return
    try:
        f = open_regular(path, append=False)
    except OSError as exc:
        what = ("a symbolic link" if os.path.islink(path) else "not a regular file" if not stat.S_ISREG(os.lstat(path).st_mode)
                else f"unreadable ({exc.strerror})")
        raise CheckpointError(str(path), f"is {what}, not the journal asyncrl wrote", FIX) from None
    seen, h = 0, hashlib.blake2b(digest_size=16)
    with f:
        for at, body in frames(f, os.fstat(f.fileno()).st_size):
            _record(body, path, at)
            if seen < records:
                h.update(body)
            seen += 1
    if seen < records:
        raise CheckpointError(str(path), f"holds {seen} tool results, fewer than the {records} the checkpoint counted (cut short or replaced)", FIX)
    if digest is not None and records and h.hexdigest() != digest:
        raise CheckpointError(str(path), f"its first {records} tool results are not those the checkpoint saw (rewritten)", FIX)
