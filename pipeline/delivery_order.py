"""In which order a worker hands the records of one poll to its streams: by class.

A worker's consumer fetches the request topic and the four work topics together, and each poll
(up to ``SURGE_MAX_POLL_RECORDS`` records) is handed to the streams one record per turn of the event
loop, while the readers work on what they got. Faust's default order is round robin over the topics,
so under load a real-time request or work item at the end of a poll waited for the records of
every other topic in it to be handed over first (docs/architecture.md, "Delivering records"). Here the
request topic goes first (the intake decides every class, and real-time requests are among its
records), then the work topics from real-time to offline, then anything else (changelogs, risk
topics) as before. Only the order within one poll changes: every record of a poll is still handed
over before the next poll, each partition's records stay in offset order, and topics of one rank
keep Faust's round robin.

Pure: no Faust or Kafka here (pipeline/app.py wraps it in Faust's scheduling strategy).
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.terms import Priority
from pipeline.topics import TopicNames


def topic_ranks(topics: TopicNames) -> dict[str, int]:
    """0 for the request topic, 1-4 for the work topics from real-time to offline; topics not named
    rank after them (:func:`rank_groups`)."""
    ranks = {topics.requests: 0}
    for priority in Priority:
        ranks[topics.work(priority)] = 1 + priority.rank
    return ranks


def rank_groups(present: Iterable[str], ranks: dict[str, int]) -> list[list[str]]:
    """The topics of one poll in delivery order: groups of equal rank, highest first, each group in
    the order given (the order Faust would take them round robin); unranked topics last, together."""
    last = 1 + max(ranks.values(), default=0)
    by_rank: dict[int, list[str]] = {}
    for topic in present:
        by_rank.setdefault(ranks.get(topic, last), []).append(topic)
    return [by_rank[rank] for rank in sorted(by_rank)]
