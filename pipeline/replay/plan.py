"""The pure parts of a replay (docs/architecture.md, "Replay"): times, the offset range, the replay's
own names and environment, the throttle, shadow sampling and the rewrite of a copied request.

No Kafka or Faust imports: the runner (:mod:`pipeline.replay.runner`) asks the broker for offsets and
hands them here.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from pipeline.auth import Headers, KeyRing, header_list, resign
from pipeline.exceptions import RequestSignatureError, SurgeError
from pipeline.replyto import ReplyToPolicy
from pipeline.topics import TopicNames

#: how long before ``--from`` risk features are warmed (the longest window, 24 h)
RISK_WARMUP_MS = 86_400_000
#: the topics a replay reads, by the name ``--topic`` gives them
SOURCES = ("requests", "risk-events")
#: settings a replay sets itself and ``--set`` may not change: its identity, and what keeps it apart
#: from live traffic
IDENTITY_KEYS = frozenset(
    {
        "broker",
        "app_id",
        "topic_prefix",
        "data_dir",
        "role",
        "web_port",
        "reply_topic_pattern",
        "static_membership",
        "group_instance_id",
        "worker_id",
        "partitions",
    }
)
#: what a replay (and a shadow) changes by default, and why (docs/architecture.md, "Replay"):
#: deadlines off (an old request must not expire because it is old), degradation off (its level
#: depends on how fast the replay runs): with the cache mode below, every answer is then a function
#: of the request, the model and the settings alone
REPLAY_DEFAULTS: dict[str, str] = {
    "deadlines_enabled": "false",
    "degrade_enabled": "false",
    "standby_replicas": "false",
    "static_membership": "false",
}
#: ``--caches``: ``exact`` (default): the exact cache only, empty at start (an exact hit is the answer
#: the model gives that normalised text, whenever it is found); ``off``: every request asks the model;
#: ``live``: caches, semantic cache and merging as live traffic has them, empty at start (whether a
#: request meets another's answer then depends on what is in flight at the same moment)
CACHE_MODES: dict[str, dict[str, str]] = {
    "exact": {"cache_enabled": "true", "semantic_cache_enabled": "false", "dedup_enabled": "false"},
    "off": {"cache_enabled": "false", "dedup_enabled": "false"},
    "live": {},
}

_RELATIVE = re.compile(r"^(?:now)?\s*-\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class ReplayError(SurgeError):
    """A replay or shadow that cannot run as asked."""


class ReplayLabelsError(ReplayError):
    """A ``--labels`` file that cannot be read, or a line of it that is not a label (checked before
    the replay creates anything)."""

    def __init__(self, path: str, reason: str, line: int | None = None) -> None:
        where = f"{path}, line {line}" if line is not None else path
        super().__init__(
            f"--labels {where}: {reason} (JSON lines with event_id and a label 0 or 1, as `surge risk "
            "simulate` writes them)"
        )
        self.path = path
        self.line = line


class ReplayTimeError(ReplayError):
    """A ``--from``/``--to`` that is not a time."""

    def __init__(self, text: str) -> None:
        super().__init__(
            f"cannot read {text!r} as a time: give epoch milliseconds (1735689600000), ISO 8601 "
            "(2025-01-01T00:00:00Z; no zone means UTC), 'now', or a time ago ('-2h', '-30m', '-1d')"
        )
        self.text = text


class ReplayRangeError(ReplayError):
    """An empty or reversed time range."""

    def __init__(self, from_ms: int, to_ms: int) -> None:
        super().__init__(
            f"--from {from_ms} ms must be before --to {to_ms} ms (the range is {to_ms - from_ms} ms long)"
        )
        self.from_ms = from_ms
        self.to_ms = to_ms


class ReplaySettingError(ReplayError):
    """A ``--set KEY=VALUE`` the replay cannot apply."""

    def __init__(self, item: str, reason: str) -> None:
        super().__init__(f"--set {item!r}: {reason}")
        self.item = item


class ShadowPercentError(ReplayError):
    """A shadow share that is not a percentage above 0 and at most 100."""

    def __init__(self, percent: float) -> None:
        super().__init__(
            f"shadow share {percent:g} %: the share of live requests mirrored must be a percentage above "
            "0 and at most 100 (surge shadow --percent, surge replay --shadow)"
        )
        self.percent = percent


class ShadowWindowError(ReplayError):
    """A comparison window that holds no request."""

    def __init__(self, window: int) -> None:
        super().__init__(f"shadow window {window}: the comparison must cover at least 1 sampled request")
        self.window = window


class ShadowTaskError(ReplayError):
    """One of a shadow's tasks (the sampler, the live-reply reader, the report loop) ended while the
    shadow ran: the shadow stops, writes its final report and exits non-zero."""

    def __init__(self, task: str, cause: BaseException | None) -> None:
        why = "ended" if cause is None else f"failed: {type(cause).__name__}: {cause}"
        super().__init__(f"the shadow's {task} {why}; the shadow stopped (its report covers what it had)")
        self.task = task
        self.cause = cause


def parse_time(text: str, now_ms: int) -> int:
    """Epoch milliseconds of ``text``: epoch ms, ISO 8601 (UTC without a zone), ``now`` or ``-2h``."""
    t = text.strip()
    if t == "now":
        return now_ms
    if re.fullmatch(r"\d{10,14}", t):
        return int(t)
    m = _RELATIVE.match(t)
    if m:
        return now_ms - int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ReplayTimeError(text) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def check_range(from_ms: int, to_ms: int) -> None:
    if from_ms >= to_ms:
        raise ReplayRangeError(from_ms, to_ms)


@dataclass(frozen=True, slots=True)
class ReplayNames:
    """The replay's own identity: app id ``<app>-<kind>-<id>``, topic prefix ``<prefix><kind>.<id>.``."""

    live_app_id: str
    live_prefix: str
    replay_id: str
    kind: str = "replay"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.replay_id):
            raise ReplayError(f"replay id {self.replay_id!r} must be 1-64 of A-Z a-z 0-9 _ -")

    @property
    def app_id(self) -> str:
        return f"{self.live_app_id}-{self.kind}-{self.replay_id}"

    @property
    def prefix(self) -> str:
        return f"{self.live_prefix}{self.kind}.{self.replay_id}."

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.prefix)

    def owns(self, topic: str) -> bool:
        """Whether ``topic`` belongs to this replay (the only topics it may write or delete)."""
        return topic.startswith(self.prefix) or topic.startswith(f"{self.app_id}-")


def new_replay_id(now_ms: int, token: str) -> str:
    """``YYYYmmddHHMMSS-<token>``: sortable, and unique with a random ``token``."""
    stamp = datetime.fromtimestamp(now_ms / 1000, tz=UTC).strftime("%Y%m%d%H%M%S")
    return f"{stamp}-{token}"


@dataclass(frozen=True, slots=True)
class PartitionRange:
    """Offsets ``[start, end)`` of one partition."""

    partition: int
    start: int
    end: int

    @property
    def count(self) -> int:
        return max(0, self.end - self.start)


def plan_ranges(
    from_offsets: Mapping[int, int | None],
    to_offsets: Mapping[int, int | None],
    end_offsets: Mapping[int, int],
) -> list[PartitionRange]:
    """The offsets to copy per partition. ``from_offsets``/``to_offsets``: the first offset whose
    timestamp is at or after ``--from``/``--to`` (Kafka's ``offsets_for_times``), None when no record
    is that late; ``end_offsets``: the log end. Partitions with nothing in range are left out."""
    out = []
    for p in sorted(end_offsets):
        end_of_log = end_offsets[p]
        start = from_offsets.get(p)
        start = end_of_log if start is None else start
        stop = to_offsets.get(p)
        stop = end_of_log if stop is None else min(stop, end_of_log)
        r = PartitionRange(p, start, stop)
        if r.count:
            out.append(r)
    return out


class Throttle:
    """Paces a copy at ``rate_per_s`` records per second (0: as fast as it goes). ``clock`` is seconds."""

    def __init__(self, rate_per_s: float, clock: Callable[[], float]) -> None:
        self.rate_per_s = rate_per_s
        self.clock = clock
        self._next: float | None = None

    def delay(self, n: int = 1) -> float:
        """Seconds to wait before sending ``n`` more records (then they are counted as sent)."""
        if self.rate_per_s <= 0:
            return 0.0
        now = self.clock()
        start = now if self._next is None else max(self._next, now)
        self._next = start + n / self.rate_per_s
        return start - now


def sampled(request_id: str, percent: float) -> bool:
    """Whether a request belongs to the shadow's share: by a hash of its id, so every shadow process
    (and a rerun) samples the same requests."""
    if percent >= 100:
        return True
    if percent <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 * 100 < percent


#: how far before the sampler's resume time the shadow reads live replies: a reply stamped by another
#: machine's clock than its request's may carry an earlier time
LIVE_REPLY_SKEW_MS = 60_000


def live_replies_from(first_unread_ms: Mapping[object, int | None], now_ms: int) -> int:
    """The time the shadow's live-reply reader starts from (docs/architecture.md, "Replay"): the oldest
    timestamp of the first request record the sampler has yet to read in each of its partitions (None
    where it has read them all), or ``now_ms`` when it has read every one; less
    :data:`LIVE_REPLY_SKEW_MS`. So a restarted shadow, which resumes from its group's committed
    offsets, finds the live replies of the requests it catches up on."""
    times = [ms for ms in first_unread_ms.values() if ms is not None]
    return min([now_ms, *times]) - LIVE_REPLY_SKEW_MS


@dataclass(frozen=True, slots=True)
class Copy:
    """A request record as the replay writes it, and what it needs to find the live reply."""

    value: bytes
    #: ``(user_id, request_id)`` when readable (a record without them gets no reply anywhere)
    ids: tuple[str, str] | None
    #: where live traffic answered it
    live_reply_topic: str | None
    #: the headers the copy is written with (a rewritten value signed again, :func:`resigned`)
    headers: tuple[tuple[str, bytes], ...] = ()


def resigned(
    headers: Headers, original: bytes, value: bytes, signers: KeyRing | None
) -> tuple[tuple[str, bytes], ...]:
    """The headers of a copy whose value is ``value`` in place of ``original``: when ``original``'s
    signature verifies with the live deployment's ``signers``, the signature headers are replaced by
    the same key's signature of ``value`` (its ``reply_to`` rewritten, the old one no longer matches);
    otherwise they are kept as they are, so a copy of a record live traffic refused is refused by the
    replay as well. ``signers`` None (live takes records as written): kept as they are."""
    kept = tuple(header_list(headers) or ())
    if signers is None:
        return kept
    try:
        key = signers.verify(headers, original)
    except RequestSignatureError:
        return kept
    return tuple(resign(headers, key, value))


def rewrite_request(
    raw: bytes | None,
    replay_replies: str,
    live_policy: ReplyToPolicy,
    headers: Headers = None,
    signers: KeyRing | None = None,
) -> Copy:
    """The copy of one live request record: ``reply_to`` becomes the replay's replies topic when live
    traffic accepted it; everything else (request_id, created_at, ...) is kept. A ``reply_to`` live
    traffic refused is kept as it was (the replay refuses it too and answers on its own replies
    topic); a record that is not a JSON object is copied byte for byte. ``headers`` go with the copy,
    signed again where the value changed (:func:`resigned`, with the live ``signers``)."""
    from pipeline.records import salvage_ids

    as_is = tuple(header_list(headers) or ())
    ids = salvage_ids(raw)
    if ids is None:
        return Copy(raw or b"", None, None, as_is)
    rid, uid, reply_to = ids
    live_topic = live_policy.safe(reply_to)
    try:
        data = json.loads(raw or b"")
    except ValueError:  # salvage_ids read it; stay safe anyway
        return Copy(raw or b"", (uid, rid), live_topic, as_is)
    original = data.get("reply_to")
    accepted = original is None or live_policy.safe(original) == original
    if not accepted:
        return Copy(raw or b"", (uid, rid), live_topic, as_is)
    data["reply_to"] = replay_replies
    value = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return Copy(value, (uid, rid), live_topic, resigned(headers, raw or b"", value, signers))


def sent_on_originals(
    records: Sequence[tuple[int, bytes | None, bytes | None]], home: Callable[[bytes], int]
) -> set[int]:
    """The indexes of ``(partition, key, value)`` request records the live intake sent on rather than
    served: those without a key or off the partition their key hashes to (``home``), whose value
    also lies in the range on its home partition (the copy the intake sent there). The copy is the
    one live traffic answered; replaying both would ask the model twice for one request. An original
    whose copy fell outside the range is kept: it is the only record of its request in the range."""

    def on_home(partition: int, key: bytes | None) -> bool:
        return key is not None and partition == home(key)

    homed = {value for partition, key, value in records if value is not None and on_home(partition, key)}
    return {
        i
        for i, (partition, key, value) in enumerate(records)
        if value is not None and not on_home(partition, key) and value in homed
    }


def parse_sets(items: Sequence[str], field_names: Sequence[str]) -> dict[str, str]:
    """``["max_batch_size=16", "SURGE_FAQ_CONFIDENCE_FLOOR=0.5"]`` → ``{field: value}``; identity keys
    and unknown fields are refused."""
    out: dict[str, str] = {}
    known = set(field_names)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ReplaySettingError(item, "expected KEY=VALUE")
        name = key.strip().lower().removeprefix("surge_")
        if name not in known:
            raise ReplaySettingError(item, f"no setting {name!r} (see README.md, 'Configuration')")
        if name in IDENTITY_KEYS:
            raise ReplaySettingError(item, f"{name!r} is the replay's own; it is set by the replay")
        out[name] = value
    return out


def env_value(value: object) -> str | None:
    """A setting's value as an environment variable reads it (None: leave it unset)."""
    if value is None:
        return None
    if hasattr(value, "get_secret_value"):
        return str(value.get_secret_value())
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return json.dumps(list(value))
    return str(value)


def live_env(values: Mapping[str, object]) -> dict[str, str]:
    """``SURGE_*`` variables of the live settings given explicitly (``values``: field → value), less
    the identity keys: the replay starts from what live traffic ran with."""
    out = {}
    for name, value in values.items():
        text = env_value(value)
        if name not in IDENTITY_KEYS and text is not None:
            out[f"SURGE_{name.upper()}"] = text
    return out


def worker_env(
    names: ReplayNames,
    *,
    broker: str,
    data_dir: str,
    partitions: int,
    role: str,
    model: str | None = None,
    sets: Mapping[str, str] | None = None,
    caches: str = "exact",
    live: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ``SURGE_*`` environment of the replay's worker: the ``live`` settings (:func:`live_env`),
    :data:`REPLAY_DEFAULTS`, the cache mode (:data:`CACHE_MODES`), ``model``, ``sets``, then its
    identity."""
    if caches not in CACHE_MODES:
        raise ReplayError(f"--caches {caches!r}: one of {', '.join(CACHE_MODES)}")
    env = dict(live or {})
    env.update({f"SURGE_{k.upper()}": v for k, v in {**REPLAY_DEFAULTS, **CACHE_MODES[caches]}.items()})
    if model:
        env["SURGE_MODEL"] = model
    env.update({f"SURGE_{k.upper()}": v for k, v in (sets or {}).items()})
    env.update(
        {
            "SURGE_BROKER": broker,
            "SURGE_APP_ID": names.app_id,
            "SURGE_TOPIC_PREFIX": names.prefix,
            "SURGE_DATA_DIR": data_dir,
            "SURGE_PARTITIONS": str(partitions),
            "SURGE_ROLE": role,
            # the replay's own replies topic and nothing else: a reply never reaches a live topic
            "SURGE_REPLY_TOPIC_PATTERN": "",
            "SURGE_GROUP_INSTANCE_ID": "",
            "SURGE_WORKER_ID": f"{names.kind}-{names.replay_id}",
        }
    )
    return env


def changed_settings(model: str | None, live_model: str, sets: Mapping[str, str]) -> list[str]:
    """What the replay changed against live traffic (named in the report's causes)."""
    out = sorted(sets)
    if model and model != live_model:
        out.insert(0, "model")
    return out
