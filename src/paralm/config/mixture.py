"""`data.mixture` entries (`PATH:WEIGHT`) parsed into sources with normalised weights: a config rule
checks them up front, and `paralm.data.mixture` samples from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paralm.errors import UserError


@dataclass(frozen=True)
class Source:
    path: Path
    weight: float
    name: str


def parse_mixture(entries: list[str]) -> list[Source]:
    """`PATH:WEIGHT` entries as sources with normalised weights; bad entries are one-line errors."""
    parsed = []
    for entry in entries:
        path, sep, weight = entry.rpartition(":")
        try:
            value = float(weight) if sep and path else None
        except ValueError:
            value = None
        if value is None or not np.isfinite(value):
            raise UserError(f"data.mixture entry {entry!r} is not PATH:WEIGHT: write e.g. data/a:0.7")
        if value < 0:
            raise UserError(f"data.mixture weight of {path} is negative ({weight}): weights must be >= 0")
        parsed.append((Path(path), value))
    total = sum(w for _, w in parsed)
    if total <= 0:
        raise UserError("data.mixture weights sum to zero: give at least one source a positive weight")
    names = [p.name or str(p) for p, _ in parsed]
    return [
        Source(p, w / total, n if names.count(n) == 1 else f"{n}.{i}")
        for i, ((p, w), n) in enumerate(zip(parsed, names, strict=True))
    ]
