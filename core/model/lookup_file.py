"""The built-in ``lookup`` tool's table (``tools: [{name: lookup, data: FILE}]``): JSON Lines, one
``{"key": "...", "value": "..."}`` object a line; blank lines are skipped, other fields ignored,
and of a key given twice (case and surrounding space ignored) the first is kept."""

from __future__ import annotations

from pathlib import Path

from core.model.bounded_parse import TooNested, loads_json
from core.model.regular_file import UnreadableFile, read_regular

MAX_FILE_BYTES = 64 << 20  # read whole into memory, once, before the run
MAX_ENTRIES = 1_000_000
FIX = 'give a .jsonl file of {"key": "...", "value": "..."} lines'


class LookupFileError(ValueError):
    """The file cannot be read, or a line is not a key and a value (one line, numbered)."""

    def __init__(self, problem: str, fix: str = FIX) -> None:
        super().__init__(problem)
        self.problem, self.fix = problem, fix


def key_of(text: str) -> str:
    """What a key and a query are compared by: case and runs of space ignored."""
    return " ".join(text.split()).casefold()


def read_lookup(path: str | Path) -> dict[str, tuple[str, str]]:
    """The table of ``path``: each key's ``key_of`` -> (the key as written, its value)."""
    try:
        data = read_regular(path, MAX_FILE_BYTES, FIX)
    except UnreadableFile as exc:
        raise LookupFileError(exc.problem, exc.fix) from None
    table: dict[str, tuple[str, str]] = {}
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            row = loads_json(raw)
        except UnicodeDecodeError:
            raise LookupFileError(f"line {n}: not UTF-8") from None
        except TooNested as exc:
            raise LookupFileError(f"line {n}, column {exc.column}: {exc.problem}") from None
        except ValueError:
            raise LookupFileError(f"line {n}: not JSON") from None
        if not (isinstance(row, dict) and isinstance(row.get("key"), str) and isinstance(row.get("value"), str)):
            raise LookupFileError(f'line {n}: not an object with a "key" and a "value" that are text')
        if len(table) >= MAX_ENTRIES:
            raise LookupFileError(f"more than {MAX_ENTRIES} entries", "split the table, or keep the keys the task needs")
        table.setdefault(key_of(row["key"]), (row["key"], row["value"]))
    return table
