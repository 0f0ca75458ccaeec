"""The built-in ``lookup`` tool: a key-value search over a local JSONL file, one
``{"key": ..., "value": ...}`` object a line, read once when the tool is built (before the run).

``lookup(query=...)`` answers the value of the key equal to the query (case and surrounding
space ignored); failing that, up to ``MAX_MATCHES`` ``key: value`` lines of the keys that contain
it, in key order; failing that, that nothing matched. The answer depends only on the file and
the query.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_MATCHES = 3
MAX_FILE_BYTES = 64 * 2**20
MAX_ENTRIES = 1_000_000


class LookupFileError(ValueError):
    """The file is not a lookup table: the message names the line and what is wrong."""


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


class Lookup:
    """The table of one JSONL file."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise LookupFileError(f"{path} is not a file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise LookupFileError(f"{path} is larger than {MAX_FILE_BYTES // 2**20} MiB")
        self.path = path
        self.table: dict[str, tuple[str, str]] = {}
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise LookupFileError(f"{path} line {n}: not JSON") from None
                if not (isinstance(row, dict) and isinstance(row.get("key"), str) and isinstance(row.get("value"), str)):
                    raise LookupFileError(f'{path} line {n}: not an object with a "key" and a "value" that are text')
                if len(self.table) >= MAX_ENTRIES:
                    raise LookupFileError(f"{path}: more than {MAX_ENTRIES} entries")
                self.table.setdefault(_norm(row["key"]), (row["key"], row["value"]))  # the first of a repeated key
        self._keys = sorted(self.table)

    def __call__(self, query: str) -> str:
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be non-empty text")
        q = _norm(query)
        if q in self.table:
            return self.table[q][1]
        hits = [self.table[k] for k in self._keys if q in k][:MAX_MATCHES]
        if not hits:
            return f"no entry matches {query.strip()!r}"
        return "\n".join(f"{key}: {value}" for key, value in hits)
