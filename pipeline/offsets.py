"""Which offsets of a partition may be committed: the done prefix from where reading started.

Records of one partition finish out of order in surge (a cache hit overtakes a queued question,
real-time overtakes batch, a merged follower finishes with its leader). Committing past a record
that is not finished loses it on a crash, so an offset may only be committed once every record
before it on its partition is finished. Records may also *arrive* out of order: after a rebalance
the fetcher can hand over records it fetched from an older position before those from the
committed offset. So a :class:`PartitionLedger` starts at the offset its owner started reading from
(the group's committed offset, else the log start), takes records in any order, drops repeats, and
releases only the finished run from that start (docs/architecture.md, "Guarantees").

An offset that is not in the log at all (a transaction marker, a compacted record) would hold the
run back for ever; the agent that finds such a hole confirms it with the broker and skips it
(:meth:`PartitionLedger.skip_to`). One answer of the broker lists the records it holds over a
stretch, so every offset missing from it is marked absent at once (:meth:`PartitionLedger.mark_absent`)
and the run steps over each as it reaches it: a producer writing in transactions leaves a marker after
each, and stepping over one marker per question held the commit point near where reading began
while the reader went on (docs/architecture.md, "Transactional producers").

A record taken on may also be *given back* (:meth:`PartitionLedger.put_back`): a rebalance's drain
hands back admitted work that has not reached the model, so the partition's owner reads it again.
The run never passes a given-back offset, so it is never committed by this owner; it no longer
counts as in flight. And what a ledger finished but could not release (behind an unfinished or
given-back record) is what the partition's next owner need not do again
(:meth:`PartitionLedger.finished_unreleased`, carried in the commit's metadata by
:func:`encode_done`).

Pure: no Kafka or Faust imports.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from pipeline.exceptions import SurgeError

T = TypeVar("T")


class LedgerError(SurgeError):
    """An offset was finished that the ledger never saw, or that was already released."""


class PartitionLedger(Generic[T]):
    """Offsets of one partition read since ``start``, each with a token handed back once releasable.

    :meth:`read` is called by the agent as it takes a record from the stream, :meth:`finish` when
    what the record produced has been acknowledged by the broker. ``finish`` returns the tokens of
    the records that may now be acked, in offset order: the finished run from the start.
    ``start`` None: the first offset read is the start (used where nothing else is known).
    """

    def __init__(self, start: int | None = None) -> None:
        self._entries: dict[int, list[object]] = {}  # offset -> [done, token]
        self._given_back: set[int] = set()  # taken on, then handed back unfinished: never released
        self._absent: set[int] = set()  # not in the log (the broker said so): stepped over
        self._unfinished = 0
        self._base = start  # the next offset to release
        self._last: int | None = None
        self.released = 0
        #: the offset to commit for what was released so far (last released + 1), None before any
        self.commit_point: int | None = None

    def __len__(self) -> int:
        """Records read and not yet released (given-back ones left out: nobody works on them)."""
        return len(self._entries)

    @property
    def in_flight(self) -> int:
        """Records read and not finished (nor given back): what a drain waits for."""
        return self._unfinished

    def __contains__(self, offset: object) -> bool:
        """Whether ``offset`` was read and is not released yet."""
        return offset in self._entries

    @property
    def last_read(self) -> int | None:
        """The highest offset read."""
        return self._last

    @property
    def next_release(self) -> int | None:
        """The offset the released run waits for next (None before the first read without a start)."""
        return self._base

    def is_repeat(self, offset: int) -> bool:
        """Whether :meth:`read` would refuse ``offset`` now (in flight here, already released, or
        before the start); reads nothing. Lets a reader drop a repeat delivery before it waits for
        anything (the hole check's seek delivers every record after the hole again)."""
        return self._base is not None and (
            offset < self._base or offset in self._entries or offset in self._given_back
        )

    def read(self, offset: int, token: T) -> bool:
        """Register a record as it is read; False for a repeat (in flight here, already released,
        or before the start), which the reader drops untouched."""
        if self._base is None:
            self._base = offset
        if self.is_repeat(offset):
            return False
        self._entries[offset] = [False, token]
        self._unfinished += 1
        if self._last is None or offset > self._last:
            self._last = offset
        return True

    def finish(self, offset: int) -> list[T]:
        """Mark a record finished; returns the tokens now releasable (possibly none), in order. A
        given-back record stays given back."""
        entry = self._entries.get(offset)
        if entry is None:
            if offset in self._given_back:  # its work was under way after all: it stays unreleased
                return []
            raise LedgerError(f"offset {offset} was never read, or was already released")
        if not entry[0]:
            self._unfinished -= 1
        entry[0] = True
        return self._release()

    def put_back(self, offset: int) -> None:
        """Hand a record taken on back unfinished: it stays unreleased (the run stops at it), is no
        longer in flight, and a delivery of it again in this generation is a repeat."""
        entry = self._entries.get(offset)
        if entry is None or entry[0]:
            raise LedgerError(f"offset {offset} is not in flight here: it cannot be given back")
        del self._entries[offset]
        self._unfinished -= 1
        self._given_back.add(offset)

    @property
    def given_back(self) -> int:
        """How many records were given back."""
        return len(self._given_back)

    def finished_unreleased(self) -> set[int]:
        """Offsets finished here but held back from the run (behind an unfinished or given-back
        record): their outputs are on the broker, so reading them again needs no work."""
        return {offset for offset, (done, _) in self._entries.items() if done}

    def resume_point(self) -> int | None:
        """The first offset from the next release on that was not read: where reading must go on
        when records delivered but not yet taken were thrown away (None before the first read
        without a start). Records after it that were read come again and are dropped as repeats."""
        point = self._base
        if point is None:
            return None
        while point in self._entries or point in self._given_back:
            point += 1
        return point

    def hole(self) -> int | None:
        """The offset the run waits for when it was never read though later ones were, else None."""
        base = self._base
        if self._entries and base is not None and base not in self._entries and base not in self._given_back:
            return base
        return None

    def skip_to(self, offset: int) -> list[T]:
        """Offsets from the next release up to ``offset`` (excluded) are not in the log: step over
        them. Returns the tokens now releasable."""
        if self._base is not None and offset > self._base:
            if any(o < offset for o in self._entries):
                raise LedgerError(f"cannot skip to {offset}: records before it were read")
            self._base = offset
            self.commit_point = offset
        return self._release()

    def mark_absent(self, offsets: Iterable[int]) -> list[T]:
        """``offsets`` are not in the log (the broker listed the records around them): the run
        steps over each when it reaches it. Offsets before the next release, or read, are ignored.
        Returns the tokens now releasable."""
        base = self._base
        self._absent.update(
            o
            for o in offsets
            if (base is None or o >= base) and o not in self._entries and o not in self._given_back
        )
        return self._release()

    def _release(self) -> list[T]:
        out: list[T] = []
        base = self._base
        entries, absent = self._entries, self._absent
        moved = False
        while base is not None:
            if base in entries and entries[base][0]:
                out.append(entries.pop(base)[1])  # type: ignore[arg-type]
            elif base in absent:
                absent.discard(base)
            else:
                break
            base += 1
            moved = True
        if moved:
            self._base = base
            self.commit_point = base
            self.released += len(out)
        return out

    def oldest_unfinished(self) -> int | None:
        """The offset that holds back the commit point, or None when nothing is pending."""
        pending = [o for o, (done, _) in self._entries.items() if not done] + list(self._given_back)
        return min(pending) if pending else None


def not_held(start: int, held: list[int]) -> list[int]:
    """The offsets from ``start`` up to the last of ``held`` (the records the log holds from
    ``start`` on, ascending, as the broker listed them) that hold no record."""
    if not held:
        return []
    present = set(held)
    return [o for o in range(start, held[-1]) if o not in present]


#: prefix of the commit metadata that lists offsets finished past the committed one
DONE_PREFIX = "surge-done:"
#: longest metadata written: the broker refuses a commit over offset.metadata.max.bytes (4096 by
#: default), so a long list keeps its lowest offsets (the rest are simply answered again)
DONE_MAX_CHARS = 3000


def encode_done(done: Iterable[int], committed: int, max_chars: int = DONE_MAX_CHARS) -> str:
    """Commit metadata naming the offsets after ``committed`` that are finished already (their
    outputs on the broker), as ranges relative to it: ``surge-done:2-5,9``. Whoever reads the
    partition from ``committed`` next may ack those without work (docs/architecture.md,
    "Guarantees"). Empty when there are none."""
    rel = sorted({offset - committed for offset in done if offset > committed})
    if not rel:
        return ""
    parts: list[str] = []
    size = len(DONE_PREFIX)
    start = prev = rel[0]
    for value in [*rel[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        part = str(start) if start == prev else f"{start}-{prev}"
        if size + len(part) + 1 > max_chars:
            break
        parts.append(part)
        size += len(part) + 1
        if value is not None:
            start = prev = value
    return DONE_PREFIX + ",".join(parts) if parts else ""


def decode_done(metadata: str | None, committed: int, limit: int = 1_000_000) -> set[int]:
    """The offsets :func:`encode_done` wrote for ``committed``; empty for anything else (metadata
    written by another client, or malformed), never an error."""
    if not metadata or not metadata.startswith(DONE_PREFIX):
        return set()
    out: set[int] = set()
    try:
        for part in metadata[len(DONE_PREFIX) :].split(","):
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 1 or last < first or last - first > limit or len(out) + last - first >= limit:
                return set()
            out.update(range(committed + first, committed + last + 1))
    except ValueError:
        return set()
    return out
