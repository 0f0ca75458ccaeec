"""The built-in ``lookup`` tool: a key-value search over a local JSONL table
(core/model/lookup_file.py), read once when the tool is built, before the run.

``lookup(query=...)`` answers the value of the key equal to the query (case and surrounding
space ignored); failing that, up to ``MAX_MATCHES`` ``key: value`` lines of the keys that contain
it, in key order; failing that, that nothing matched. The answer depends only on the file and
the query.
"""

from __future__ import annotations

from pathlib import Path

from core.model.lookup_file import key_of, read_lookup

MAX_MATCHES = 3


class Lookup:
    """The table of one JSONL file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.table = read_lookup(self.path)
        self._keys = sorted(self.table)

    def __call__(self, query: str) -> str:
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be non-empty text")
        q = key_of(query)
        if q in self.table:
            return self.table[q][1]
        hits = [self.table[k] for k in self._keys if q in k][:MAX_MATCHES]
        if not hits:
            return f"no entry matches {query.strip()!r}"
        return "\n".join(f"{key}: {value}" for key, value in hits)
