"""Compact JSON for the risk path's hot records: entity states, repartition packs, decisions.

orjson, not the standard library: a risk worker writes four entity states and one decision per event,
and ``json.dumps`` was 7 % of a worker's CPU draining a backlog; orjson writes the same compact JSON
about ten times faster (byte for byte for ASCII text; other text as UTF-8 instead of ``\\u`` escapes). See
docs/architecture.md, "Risk: the chain". Sets (an entity's distinct values) become lists; a numpy
scalar (a model's score) becomes its Python number. A lone surrogate cannot be written (TypeError):
validated records never hold one, and salvaged ids refuse them (:func:`pipeline.records.salvaged_id`).
"""

from __future__ import annotations

from typing import Any

import orjson


def _default(obj: Any) -> Any:
    if isinstance(obj, set | frozenset):
        return list(obj)
    item = getattr(obj, "item", None)  # numpy scalars
    if callable(item):
        return item()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON bytes (no spaces), as ``json.dumps(obj, separators=(",", ":"))`` gives."""
    return orjson.dumps(obj, default=_default)


def loads(data: bytes | str) -> Any:
    """JSON to Python objects; ``ValueError`` (orjson's ``JSONDecodeError``) on anything else."""
    return orjson.loads(data)
