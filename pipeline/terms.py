"""The words every part of surge shares, defined once: request classes and customer tiers.

See docs/architecture.md, "Records" and "The path of a request". Pure: no imports beyond the standard
library, so that records, settings, the scheduler, the degradation controller, the rate limiter,
the metrics and the command line can all depend on it.
"""

from __future__ import annotations

from enum import StrEnum


class Priority(StrEnum):
    """Request class, one work topic each. Declared (and iterated) from the highest to the lowest."""

    REALTIME = "realtime"
    INTERACTIVE = "interactive"
    BATCH = "batch"
    OFFLINE = "offline"

    @property
    def rank(self) -> int:
        """0 for the highest class (realtime), 3 for the lowest (offline)."""
        return RANK[self]

    @property
    def next_lower(self) -> Priority | None:
        """The next lower class (where ``delay`` moves an expired item), or None for offline. Not
        called ``lower``: that would hide ``str.lower`` of this string enum."""
        i = self.rank + 1
        return _ORDER[i] if i < len(_ORDER) else None

    def is_higher_than(self, other: Priority) -> bool:
        """True when this class is served before ``other``."""
        return self.rank < other.rank


class Tier(StrEnum):
    """Customer tier. Premium items go ahead of the others in their class; free and standard tie."""

    FREE = "free"
    STANDARD = "standard"
    PREMIUM = "premium"

    @property
    def rank(self) -> int:
        """Sort rank within a class: 0 for premium, 1 for everyone else."""
        return 0 if self is Tier.PREMIUM else 1


_ORDER: tuple[Priority, ...] = tuple(Priority)

#: the class names, highest first (plain strings: for messages, CLI choices and label values)
PRIORITIES: tuple[str, ...] = tuple(p.value for p in Priority)
#: the tier names (plain strings)
TIERS: tuple[str, ...] = tuple(t.value for t in Tier)
#: class name → rank (0 = realtime, the highest); a ``Priority`` works as a key too
RANK: dict[str, int] = {p: i for i, p in enumerate(PRIORITIES)}
