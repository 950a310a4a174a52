"""The order in which one poll's records reach a worker's streams (pipeline/delivery_order.py and its
Faust strategy in pipeline/app.py): the request topic first, then the work topics by class, then the
rest, each partition in offset order, topics of one rank round robin."""

from __future__ import annotations

from faust.types import TP

from pipeline.app import create_app, priority_scheduler
from pipeline.delivery_order import rank_groups, topic_ranks
from pipeline.settings import Settings
from pipeline.topics import TopicNames

T = TopicNames("x.")


def test_the_request_topic_ranks_first_then_the_work_topics_by_class() -> None:
    ranks = topic_ranks(T)
    order = sorted(ranks, key=ranks.__getitem__)
    assert order == [
        "x.requests",
        "x.work.realtime",
        "x.work.interactive",
        "x.work.batch",
        "x.work.offline",
    ]


def test_unranked_topics_come_last_together_in_the_order_given() -> None:
    present = ["x.replybook-changelog", "x.work.batch", "x.risk.rules", "x.requests", "x.work.realtime"]
    assert rank_groups(present, topic_ranks(T)) == [
        ["x.requests"],
        ["x.work.realtime"],
        ["x.work.batch"],
        ["x.replybook-changelog", "x.risk.rules"],
    ]
    assert rank_groups([], topic_ranks(T)) == []


def test_a_poll_is_handed_over_request_topic_first_each_partition_in_offset_order() -> None:
    records = {
        TP("x.work.offline", 0): ["o0", "o1"],
        TP("x.work.batch", 1): ["b0"],
        TP("x.requests", 0): ["q0-0", "q0-1", "q0-2"],
        TP("x.work.realtime", 2): ["r0"],
        TP("x.requests", 3): ["q3-0"],
        TP("x.other", 0): ["z0"],
        TP("x.more", 0): ["m0", "m1"],
    }
    delivered = [record for _, record in priority_scheduler(T)().iterate(records)]
    assert delivered == ["q0-0", "q3-0", "q0-1", "q0-2", "r0", "b0", "o0", "o1", "z0", "m0", "m1"]


def test_the_worker_app_uses_the_order_its_settings_name(tmp_path) -> None:
    on = create_app(Settings(data_dir=tmp_path / "a", topic_prefix="x."))
    assert on.conf.ConsumerScheduler.__name__ == "PriorityScheduling"
    off = create_app(Settings(data_dir=tmp_path / "b", delivery_order="round_robin"))
    assert off.conf.ConsumerScheduler.__name__ == "DefaultSchedulingStrategy"
