"""A file of prompts and their answers (``task.prompts``, ``task.eval_prompts``).

JSON Lines (``.jsonl``): one object per line, ``{"prompt": "...", "answer": "..."}``; blank
lines are skipped and other keys ignored. Parquet (``.parquet``, with the ``parquet`` extra:
pyarrow): string columns ``prompt`` and ``answer``, one row each. ``prompt`` is text the
model continues as it is (apply a chat template before writing it); ``answer`` is what the
reward compares the response with, and may be empty when a ``reward.fn`` needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from core.model.bounded_parse import TooNested, loads_json
from core.model.regular_file import UnreadableFile, read_regular

FIELDS = ("prompt", "answer")
MAX_FILE_BYTES = 4 << 30  # read whole into memory: a prompt set larger than this wants streaming


class PromptFileError(ValueError):
    """The file is missing, of an unknown format, empty, or a row lacks a field (one line, numbered)."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.fix = fix


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    answer: str
    where: str = field(default="", compare=False)
    """Where in its file the row is ("line 3", "row 3"), for errors found later."""


def read_prompts(path: str | Path) -> tuple[PromptRow, ...]:
    """Every row of the prompts file ``path``; ``PromptFileError`` on the first bad one."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError("no such file" if not path.exists() else "not a file")
    st = path.stat()
    return _read(str(path.resolve()), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> tuple[PromptRow, ...]:
    """Read once per file version: a run validates its scenario in several places."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        rows = _jsonl(Path(path))
    elif suffix == ".parquet":
        rows = _parquet(Path(path))
    else:
        raise PromptFileError(f"unknown format {suffix or '(no suffix)'!r}: asyncrl reads .jsonl and .parquet")
    if not rows:
        raise PromptFileError("holds no prompt")
    return tuple(rows)


def _row(obj: object, where: str) -> PromptRow:
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: a {type(obj).__name__}, not an object with {' and '.join(FIELDS)}")
    for f in FIELDS:
        if f not in obj or obj[f] is None:
            raise PromptFileError(f"{where}: no {f!r}")
        if not isinstance(obj[f], str):
            raise PromptFileError(f"{where}: {f!r} is a {type(obj[f]).__name__}, not a string")
    if not obj["prompt"].strip():
        raise PromptFileError(f"{where}: 'prompt' is empty")
    return PromptRow(obj["prompt"], obj["answer"], where)


def _jsonl(path: Path) -> list[PromptRow]:
    rows = []
    try:
        data = read_regular(path, MAX_FILE_BYTES, "give a .jsonl file of prompts and answers")
    except UnreadableFile as exc:
        raise PromptFileError(exc.problem, exc.fix) from None
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            obj = loads_json(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise PromptFileError(f"line {n}: not UTF-8") from None
        except TooNested as exc:
            raise PromptFileError(f"line {n}, column {exc.column}: {exc.problem}",
                                  "a row is an object of strings, {\"prompt\": \"...\", \"answer\": \"...\"}") from None
        except ValueError as exc:
            raise PromptFileError(f"line {n}: not JSON ({exc})") from None
        rows.append(_row(obj, f"line {n}"))
    return rows


def _parquet(path: Path) -> list[PromptRow]:
    try:  # imported on use: pyarrow costs every import of the config 0.1-0.3 s, and most runs read no parquet
        import pyarrow.parquet as pq
    except ImportError:  # the parquet extra is not installed; JSON Lines needs nothing
        raise PromptFileError("reading parquet needs pyarrow, which is not installed",
                              "pip install 'asyncrl[parquet]', or convert the file to .jsonl") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own error types for a file it cannot read
        raise PromptFileError(f"not a readable parquet file ({type(exc).__name__}: {exc})"[:300]) from None
    missing = [f for f in FIELDS if f not in table.column_names]
    if missing:
        raise PromptFileError(f"has no column {missing[0]!r} (columns: {', '.join(table.column_names)})")
    cols = table.select(list(FIELDS)).to_pylist()
    return [_row(obj, f"row {n}") for n, obj in enumerate(cols, 1)]
