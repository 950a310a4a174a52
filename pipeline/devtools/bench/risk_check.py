"""Checks of a live risk deployment against the brute-force recomputation (docs/architecture.md, "Risk").

:func:`read_arrivals` reads, from the broker, the order in which each stage saw the events: the
event topic (account stage) and the three repartition topics (card, device, ip stages), partition by
partition in offset order. :func:`check_decisions` recomputes every feature of every decision from
those events with :func:`pipeline.risk.reference.recompute` (plain Python, no tiles) and reports what
differs; it also checks that every event got a decision, that repeated decisions are identical, and
that exactly the late events were decided as late. Used by ``surge bench risk`` and the tests.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from aiokafka import TopicPartition

from pipeline.client import partitions_of
from pipeline.compat import READ_COMMITTED
from pipeline.devtools.bench.background import plain_consumer
from pipeline.risk.features import NAMES, FeatureConfig
from pipeline.risk.records import (
    ENTITY_KINDS,
    InvalidRiskEventError,
    RiskDecision,
    check_event_time,
    decode_event,
)
from pipeline.risk.reference import compare, recompute
from pipeline.risk.stages import REKEYED_KINDS, RepartitionRecordError, unpack
from pipeline.settings import Settings
from pipeline.topics import TopicNames


async def read_all(bootstrap: str, topic: str, options: dict[str, Any] | None = None) -> dict[int, list[Any]]:
    """Every committed record of ``topic`` up to its current end, by partition, in offset order (what
    the worker reads: an aborted transaction's records are not among them)."""
    consumer = plain_consumer(bootstrap, options, isolation_level=READ_COMMITTED)
    try:
        await consumer.start()
        tps = [TopicPartition(topic, p) for p in await partitions_of(consumer, topic, 100)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: dict[int, list[Any]] = {tp.partition: [] for tp in tps}
        todo = {tp for tp in tps if end[tp] > 0}
        while todo:
            batch = await consumer.getmany(*todo, timeout_ms=500)
            for tp, records in batch.items():
                out[tp.partition].extend(records)
            for tp in list(todo):
                if await consumer.position(tp) >= end[tp]:
                    todo.discard(tp)
        return out
    finally:
        await consumer.stop()


async def read_arrivals(
    settings: Settings, options: dict[str, Any] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Per entity kind, the events in the order its stage read them (valid events only). An event
    dated more than ``risk_max_ahead_ms`` after its record's timestamp counts as refused: the worker
    compares with its own clock when it reads the record, which is later, so the two differ only for
    an event within that delay of the limit."""
    from agents.risk import repartition_topic

    bootstrap = settings.bootstrap_servers
    arrivals: dict[str, list[dict[str, Any]]] = {}
    events: list[dict[str, Any]] = []
    for records in (
        await read_all(bootstrap, TopicNames(settings.topic_prefix).risk_events, options)
    ).values():
        for rec in records:
            try:
                ev = decode_event(rec.value, rec.key, max_record_bytes=settings.max_record_bytes)
                events.append(check_event_time(ev, rec.timestamp, settings.risk_max_ahead_ms).model_dump())
            except InvalidRiskEventError:
                continue
    arrivals["account"] = events
    for kind in REKEYED_KINDS:
        seen: list[dict[str, Any]] = []
        for p, records in (await read_all(bootstrap, repartition_topic(settings, kind), options)).items():
            for rec in records:
                try:
                    seen += [item["e"] for item in unpack(rec.value, (rec.topic, p, rec.offset))]
                except RepartitionRecordError:
                    continue
        arrivals[kind] = seen
    return arrivals


def check_decisions(
    arrivals: dict[str, list[dict[str, Any]]],
    decisions: Iterable[RiskDecision],
    cfg: FeatureConfig,
    expected_ids: Iterable[str] = (),
    max_examples: int = 5,
) -> dict[str, Any]:
    """Compare every decision's features with the brute-force recomputation from ``arrivals``."""
    refs: dict[str, dict[str, dict[str, Any]]] = {}
    late: set[str] = set()
    for kind in ENTITY_KINDS:
        refs[kind], lt = recompute(kind, arrivals.get(kind, []), cfg)
        if kind == "account":
            late = lt
    by_id: dict[str, list[RiskDecision]] = defaultdict(list)
    for d in decisions:
        by_id[d.event_id].append(d)
    mismatches: list[dict[str, Any]] = []
    checked = values = repeats = repeats_differing = late_wrong = errors = 0
    for eid, ds in by_id.items():
        first = ds[0]
        repeats += len(ds) - 1
        repeats_differing += sum(1 for d in ds[1:] if not d.same_as(first))
        for d in ds:
            if d.decision == "error":
                errors += 1
                continue
            checked += 1
            if d.late or eid in late:
                late_wrong += int(not (d.late and eid in late))
                continue
            for kind in ENTITY_KINDS:
                want = refs[kind].get(eid)
                if want is None:
                    if any(d.features.get(n) is not None for n in NAMES[kind]):
                        mismatches.append(
                            {"event_id": eid, "kind": kind, "diff": "features without the entity"}
                        )
                    continue
                got = {n: d.features.get(n) for n in NAMES[kind]}
                values += len(want)
                diff = compare(got, want)
                if diff:
                    mismatches.append({"event_id": eid, "kind": kind, "diff": diff[:4]})
    missing = sorted(set(expected_ids) - set(by_id))
    return {
        "events_decided": len(by_id),
        "decisions_checked": checked,
        "feature_values_checked": values,
        "mismatched_decisions": len({(m["event_id"]) for m in mismatches}),
        "mismatch_examples": mismatches[:max_examples],
        "late_expected": len(late),
        "late_wrong": late_wrong,
        "repeated_decisions": repeats,
        "repeats_differing": repeats_differing,
        "error_decisions": errors,
        "missing": len(missing),
        "missing_examples": missing[:max_examples],
    }
