"""Which offsets of a partition may be committed: the done prefix of what was read, in order.

Records of one partition finish out of order in surge (a cache hit overtakes a queued question,
real-time overtakes batch, a merged follower finishes with its leader). Committing past a record
that is not finished loses it on a crash, so an offset may only be committed once every record
before it on its partition is finished. Faust's own bookkeeping commits the first run of
consecutive acked offsets and can step over an unfinished head record (an off-by-one when the
committed offset is the next one to read, and no check at all while it is 0), so the agents never
hand Faust an ack out of order: a :class:`PartitionLedger` per partition holds what was read and
releases the finished prefix (docs/architecture.md, "Guarantees").

Pure: no Kafka or Faust imports. Offsets are whatever the reader saw, in the order it saw them;
they need not be consecutive (compaction and transaction markers leave gaps).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from pipeline.exceptions import SurgeError

T = TypeVar("T")


class LedgerError(SurgeError):
    """An offset was finished that the ledger never saw, or read twice out of order."""


class PartitionLedger(Generic[T]):
    """Offsets of one partition in read order, each with a token handed back once releasable.

    :meth:`read` is called by the agent as it takes a record from the stream, :meth:`finish` when
    what the record produced has been acknowledged by the broker. ``finish`` returns the tokens of
    the records that may now be acked, in offset order: the longest finished prefix.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[int, list[object]] = OrderedDict()  # offset -> [done, token]
        self._last: int | None = None
        self.released = 0

    def __len__(self) -> int:
        """Records read and not yet released."""
        return len(self._entries)

    def __contains__(self, offset: object) -> bool:
        """Whether ``offset`` was read and is not released yet."""
        return offset in self._entries

    @property
    def last_read(self) -> int | None:
        return self._last

    def read(self, offset: int, token: T) -> None:
        """Register a record as it is read; offsets must increase (a re-read needs a new ledger)."""
        if self._last is not None and offset <= self._last:
            raise LedgerError(f"offset {offset} read after {self._last}: a re-read needs a new ledger")
        self._last = offset
        self._entries[offset] = [False, token]

    def finish(self, offset: int) -> list[T]:
        """Mark a record finished; returns the tokens now releasable (possibly none), in order."""
        entry = self._entries.get(offset)
        if entry is None:
            raise LedgerError(f"offset {offset} was never read, or was already released")
        entry[0] = True
        out: list[T] = []
        while self._entries:
            first = next(iter(self._entries.values()))
            if not first[0]:
                break
            _, (_, token) = self._entries.popitem(last=False)
            out.append(token)  # type: ignore[arg-type]
        self.released += len(out)
        return out

    def oldest_unfinished(self) -> int | None:
        """The offset that holds back the commit point, or None when nothing is pending."""
        for offset, (done, _) in self._entries.items():
            if not done:
                return offset
        return None
