"""An empirical response-length distribution read from a file (``workload.lengths``).

The file is JSON or YAML holding one of: a list of lengths (e.g. a real run's trained
response lengths, as ``harness.calibrate`` writes them); a histogram ``{length: count}``; or
binned counts ``{edges: [...], counts: [...]}`` (len(edges) = len(counts) + 1, lengths
uniform within a bin). The sim draws a length by its quantile function.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from core.model.bounded_parse import MAX_DEPTH, TooNested, loads_json, loads_yaml
from core.model.regular_file import UnreadableFile, read_regular


class LengthFileError(ValueError):
    """The file is missing, unreadable or not one of the three shapes."""


class EmpiricalLengths:
    """The quantile function of a length distribution: ``at(u)`` for u in [0, 1).

    Item i holds the mass ``cum[i] - cum[i-1]``: the length ``lo[i]``, or when binned
    (``hi`` given) lengths spread uniformly over ``[lo[i], hi[i])``.
    """

    def __init__(self, lo: np.ndarray, cum: np.ndarray, hi: np.ndarray | None = None) -> None:
        self.lo, self.cum, self.hi = lo, cum, hi

    def at(self, u: np.ndarray) -> np.ndarray:
        x = np.asarray(u, dtype=np.float64) * self.cum[-1]
        i = np.minimum(np.searchsorted(self.cum, x, side="right"), len(self.cum) - 1)
        if self.hi is None:
            return self.lo[i].astype(np.float64)
        below = np.where(i > 0, self.cum[np.maximum(i - 1, 0)], 0.0)
        frac = (x - below) / (self.cum[i] - below)
        return self.lo[i] + frac * (self.hi[i] - self.lo[i])

    def mean(self) -> float:
        mass = np.diff(np.concatenate([[0.0], self.cum]))
        mid = self.lo if self.hi is None else 0.5 * (self.lo + self.hi)
        return float((mid * mass).sum() / self.cum[-1])


def _positive(arr: np.ndarray, what: str) -> np.ndarray:
    if arr.ndim != 1 or arr.size == 0:
        raise LengthFileError(f"{what}: needs at least one number")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise LengthFileError(f"{what}: every number must be finite and >= 0")
    return arr


def _numbers(x: object, what: str) -> np.ndarray:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise LengthFileError(f"{what}: not a list of numbers") from None
    return _positive(arr, what)


MAX_FILE_BYTES = 256 << 20  # a histogram of a few thousand bins is kilobytes
# A few aliases could otherwise stand for billions of lengths: at 64 Mi values a bomb of aliases
# built 7 GB of lists. A run's lengths (what calibrate writes) are one per trained sample: 4 Mi
# holds 8,000 steps of 512.
MAX_VALUES = 4 << 20


@lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int) -> EmpiricalLengths:
    try:
        text = read_regular(path, MAX_FILE_BYTES, "give a list of lengths, a histogram or {edges, counts}").decode()
    except UnreadableFile as exc:
        raise LengthFileError(exc.problem) from None
    except UnicodeDecodeError as exc:
        raise LengthFileError(f"cannot be read ({type(exc).__name__})") from None
    try:
        data = loads_json(text) if path.endswith(".json") else loads_yaml(text, MAX_DEPTH, MAX_VALUES)
    except TooNested as exc:
        raise LengthFileError(str(exc)) from None
    except (ValueError, yaml.YAMLError) as exc:
        raise LengthFileError(f"not JSON or YAML ({str(exc).splitlines()[0]})") from None
    if isinstance(data, list):
        v = np.sort(_numbers(data, "the list of lengths"))
        if not np.any(v >= 1):
            raise LengthFileError("the list of lengths: no length >= 1")
        return EmpiricalLengths(v, np.arange(1, v.size + 1, dtype=np.float64))
    if isinstance(data, dict) and set(data) == {"edges", "counts"}:
        edges, counts = _numbers(data["edges"], "edges"), _numbers(data["counts"], "counts")
        if edges.size != counts.size + 1 or np.any(np.diff(edges) <= 0):
            raise LengthFileError("edges must rise and have one more entry than counts")
        if counts.sum() <= 0:
            raise LengthFileError("counts are all 0")
        keep = counts > 0
        return EmpiricalLengths(edges[:-1][keep], np.cumsum(counts[keep]), edges[1:][keep])
    if isinstance(data, dict) and data:
        try:
            items = sorted((float(k), float(c)) for k, c in data.items())
        except (TypeError, ValueError):
            raise LengthFileError("a histogram maps each length to its count, both numbers") from None
        v, c = _positive(np.array([k for k, _ in items]), "lengths"), _positive(np.array([c for _, c in items]), "counts")
        if c.sum() <= 0:
            raise LengthFileError("counts are all 0")
        keep = c > 0
        return EmpiricalLengths(v[keep], np.cumsum(c[keep]))
    raise LengthFileError("expected a list of lengths, a {length: count} histogram or {edges, counts}")


def read_lengths(path: str) -> EmpiricalLengths:
    """The distribution in ``path`` (relative to the working directory); LengthFileError if bad."""
    p = Path(path)
    if not p.is_file():  # a FIFO is refused here too: reading one would block forever
        raise LengthFileError("no such file" if not p.exists() else "is not a regular file (a directory, FIFO or device)")
    return _load(str(p.resolve()), p.stat().st_mtime_ns)
