"""Errors raised in the agents; all derive from :class:`pipeline.exceptions.SurgeError`."""

from __future__ import annotations

from pipeline.exceptions import SurgeError


class WorkItemError(SurgeError):
    """A record on a work topic that is not a WorkItem (written by something other than intake).

    It cannot be answered (its request_id is unknown), so it goes to the dead-letter topic.
    """

    code = "internal"

    def __init__(self, topic: str, partition: int, offset: int, detail: str) -> None:
        super().__init__(f"undecodable work item at {topic}[{partition}]@{offset}: {detail}")
        self.topic = topic
        self.partition = partition
        self.offset = offset
