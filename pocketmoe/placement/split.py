"""Pipeline-style split of ordered pieces (embedding, layers, head) over devices of given capacities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """A unit that stays on one device: the embedding, one layer (weights + its KV), or the head."""

    label: str
    layer: int | None
    nbytes: int
    pin: str = ""  # "first" | "last" | ""

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.pin not in ("", "first", "last"):
            raise ValueError(f"piece {self.label}: bytes {self.nbytes}, pin {self.pin!r}")


def _greedy(pieces: Sequence[Piece], caps: Sequence[float]) -> list[int] | None:
    """Fill devices in order; a piece that does not fit moves on to the next device."""
    n = len(caps)
    loads = [0.0] * n
    out: list[int] = []
    g = 0
    for p in pieces:
        if p.pin == "last":
            g = n - 1
        while g < n and loads[g] + p.nbytes > caps[g]:
            if p.pin == "first":
                return None
            g += 1
        if g == n:
            return None
        loads[g] += p.nbytes
        out.append(g)
    return out


def split_pieces(pieces: Sequence[Piece], capacities: Sequence[int]) -> list[int] | None:
    """Device index of each piece, in order, or None if no ordered split fits.

    Greedy filling is optimal for an ordered split; the capacities are scaled down by bisection to
    the smallest common fraction that still fits, so the load is spread in proportion to capacity.
    """
    if not capacities or any(c < 0 for c in capacities):
        return None
    if _greedy(pieces, capacities) is None:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if _greedy(pieces, [c * mid for c in capacities]) is None:
            lo = mid
        else:
            hi = mid
    return _greedy(pieces, [c * hi for c in capacities])
