"""Tiled event-time windows (docs/architecture.md, "Risk: windows").

Each window of length ``W`` is cut into tiles of ``T`` ms (Chronon's tiling): an entity keeps one
aggregate per non-empty tile instead of one entry per event, so reading a window costs at most
``W / T`` tiles however busy the entity is. The window of an event at time ``t`` is the tiles
``[t // T - W/T + 1, t // T]``: it covers between ``W - T`` and ``W`` of history before ``t`` (and what
arrived earlier within ``t``'s own tile).

Tiles older than the window plus a reorder horizon behind the entity's latest event time (its head)
are dropped. An event whose window reaches below that floor (it is more than the horizon behind the
head) reads only the tiles still kept: the floor is part of the definition, so the brute-force
recomputation in :mod:`pipeline.risk.reference` applies the same rule.

Pure: no imports beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Window:
    """A window of ``length_ms`` made of tiles of ``tile_ms`` (``tile_ms`` divides ``length_ms``)."""

    name: str
    length_ms: int
    tile_ms: int

    def __post_init__(self) -> None:
        if self.tile_ms <= 0 or self.length_ms % self.tile_ms:
            raise ValueError(
                f"window {self.name}: tile_ms={self.tile_ms} must divide length_ms={self.length_ms}"
            )

    @property
    def tiles(self) -> int:
        """Tiles in one window."""
        return self.length_ms // self.tile_ms

    def kept(self, horizon_ms: int) -> int:
        """Tiles kept behind (and including) the head's tile: the window plus the reorder horizon."""
        return self.tiles + -(-horizon_ms // self.tile_ms)

    def floor(self, head_ms: int, horizon_ms: int) -> int:
        """Index of the oldest tile kept when the entity's latest event time is ``head_ms``."""
        return head_ms // self.tile_ms - self.kept(horizon_ms) + 1

    def span(self, t_ms: int, head_ms: int, horizon_ms: int) -> tuple[int, int]:
        """``(lo, hi)``: the tile indices (inclusive) an event at ``t_ms`` reads, given the head."""
        hi = t_ms // self.tile_ms
        return max(hi - self.tiles + 1, self.floor(head_ms, horizon_ms)), hi


#: the three windows of every entity: 1 min in 10 s tiles, 1 h in 5 min tiles, 24 h in 1 h tiles
WINDOWS: tuple[Window, ...] = (
    Window("1m", 60_000, 10_000),
    Window("1h", 3_600_000, 300_000),
    Window("24h", 86_400_000, 3_600_000),
)
