"""LeaveGroup v3: a static consumer-group member leaves by its ``group.instance.id``.

aiokafka's own LeaveGroup request stops at v1, which names the member by its member id only; v3
(Kafka 2.4, KIP-345) names each leaving member by member id and instance id. Wire format from the
Kafka protocol guide (non-flexible version, so aiokafka's plain structs encode it). Used by
:func:`pipeline.compat.leave_group_on_close_as_static_member`; see
docs/architecture.md, "Readiness and failover".
"""

from __future__ import annotations

from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Int16, Int32, Schema, String

#: Kafka's API key of LeaveGroup
LEAVE_GROUP_API_KEY = 13


class LeaveGroupResponse_v3(Response):
    API_KEY = LEAVE_GROUP_API_KEY
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("error_code", Int16),
        (
            "members",
            Array(
                ("member_id", String("utf-8")), ("group_instance_id", String("utf-8")), ("error_code", Int16)
            ),
        ),
    )


class LeaveGroupRequest_v3(RequestStruct):
    API_KEY = LEAVE_GROUP_API_KEY
    API_VERSION = 3
    RESPONSE_TYPE = LeaveGroupResponse_v3
    SCHEMA = Schema(
        ("group_id", String("utf-8")),
        ("members", Array(("member_id", String("utf-8")), ("group_instance_id", String("utf-8")))),
    )


class StaticLeaveGroupRequest(Request[LeaveGroupRequest_v3]):
    """One static member leaving ``group_id``; the client sends v3 (a broker without it: NotImplementedError)."""

    API_KEY = LEAVE_GROUP_API_KEY

    def __init__(self, group_id: str, member_id: str, group_instance_id: str) -> None:
        self.group_id = group_id
        self.member_id = member_id
        self.group_instance_id = group_instance_id

    def build(self, request_struct_class: type[LeaveGroupRequest_v3]) -> LeaveGroupRequest_v3:
        return request_struct_class(self.group_id, [(self.member_id, self.group_instance_id)])
