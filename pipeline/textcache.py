"""A cache of a function of one text, bounded by count and by bytes (docs/architecture.md,
"Security"): the normal forms, the guard's features and the merge decision's text profiles, which
every distinct question a client sends passes through."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import update_wrapper
from typing import Generic, NamedTuple, TypeVar

V = TypeVar("V")


class CacheInfo(NamedTuple):
    """:meth:`TextCache.cache_info`: what ``functools.lru_cache`` reports, and the bytes held."""

    hits: int
    misses: int
    maxsize: int
    currsize: int
    bytes: int
    max_bytes: int


def footprint(obj: object) -> int:
    """About how many bytes ``obj`` holds: a string, a number, an array, a container of those (its
    items are counted one level deep: what is cached here holds strings and numbers), or a dataclass
    of those. An object reached twice is counted twice."""
    size = sys.getsizeof(obj)
    if isinstance(obj, str):
        return size
    if isinstance(obj, tuple | list | set | frozenset):
        return size + sum(map(sys.getsizeof, obj))
    if isinstance(obj, dict):
        return size + sum(map(sys.getsizeof, obj)) + sum(map(sys.getsizeof, obj.values()))
    fields = getattr(obj, "__dataclass_fields__", None)
    if fields is not None:
        return size + sum(footprint(getattr(obj, name)) for name in fields)
    return size  # a number, or a numpy array (one that owns its data counts it in sys.getsizeof)


#: what an entry of a :class:`TextCache` costs beside its text and value: the dict's node, the pair
_ENTRY_BYTES = 120


class TextCache(Generic[V]):
    """``fn`` of one text with a least-recently-used cache bounded by count and by bytes.

    ``functools.lru_cache`` bounds the count only, and a text of the content limit (32 KiB) holds a
    hundred times what a question does: key and value together, 64 KiB in a normal form and 1.2 MiB in
    a merge profile. Here each entry's size (``footprint`` of the text and of its value) is counted
    when it is stored, and the least recently used entries go while there are more than ``maxsize``
    or they hold more than ``max_bytes``; a value over an eighth of ``max_bytes`` is returned and not
    kept (docs/architecture.md, "Security"). Thread-safe: the semantic cache is searched in the
    embedding thread. ``cache_clear`` and ``cache_info`` are those of ``lru_cache``.
    """

    def __init__(self, fn: Callable[[str], V], maxsize: int, max_bytes: int) -> None:
        self.fn = fn
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()
        update_wrapper(self, fn)

    def __call__(self, text: str) -> V:
        # a hit takes no lock: each OrderedDict call is atomic, and an entry another thread evicts in
        # between is still the right value (the counts may miss a hit then)
        entry = self._entries.get(text)
        if entry is not None:
            self._hits += 1
            try:
                self._entries.move_to_end(text)
            except KeyError:
                pass
            return entry[0]
        value = self.fn(text)
        size = _ENTRY_BYTES + footprint(text) + footprint(value)
        with self._lock:
            self._misses += 1
            if size * 8 <= self.max_bytes and text not in self._entries:
                self._entries[text] = (value, size)
                self._bytes += size
                while len(self._entries) > self.maxsize or self._bytes > self.max_bytes:
                    _, (_, dropped) = self._entries.popitem(last=False)
                    self._bytes -= dropped
        return value

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = self._hits = self._misses = 0

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(
                self._hits, self._misses, self.maxsize, len(self._entries), self._bytes, self.max_bytes
            )
