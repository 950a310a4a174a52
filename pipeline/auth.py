"""API keys of the gateway: which tenant, tier and highest priority each key may use.

Pure logic (no aiohttp, no Kafka), used by :mod:`pipeline.gateway` and validated at start by
:class:`pipeline.settings.Settings` (docs/architecture.md "Security").

``SURGE_API_KEYS`` is either a comma list ``key:tenant[:tier[:max_priority]]`` (the older
``key:tenant`` and ``key`` forms stay valid) or JSON: a list of objects
``{"key", "tenant", "tier", "max_priority"}`` or an object ``{key: {"tenant", ...}}``. A key without a
tier is ``standard``; without a highest priority, ``interactive``: real-time work must be granted.

A request may ask for a lower tier or priority than its key's, never a higher one
(:meth:`ApiKey.grant`). The ``user`` a client names is namespaced under its key's tenant
(:func:`tenant_user_id`), so that nothing a client sends reaches another tenant's rate-limit bucket.
Keys are looked up in constant time over all configured keys (:class:`KeyRing`).

Records written straight to the request topic are signed with a key where requests must be signed
(``kafka_request_auth``): header ``surge-key-id`` names the key by a hash of it (:attr:`ApiKey.key_id`,
the key itself never travels) and ``surge-signature`` holds the hex HMAC-SHA256 of the record's value
with the key as secret (:func:`sign`). The intake checks them (:meth:`KeyRing.verify`) and serves the
record as its key's tenant, with at most its key's tier and priority (:func:`authorize`): nothing a
producer writes chooses another tenant's state (docs/architecture.md, "Tenant isolation"). Each
reply to a signed request is signed back with the same key (:func:`sign_reply`, header
``surge-reply-signature``), so that its client can tell its own replies from ones another tenant's
request put on its topic under its request id (:func:`reply_signed_by`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.exceptions import (
    ApiKeyConfigError,
    InvalidRequestError,
    PermissionDeniedError,
    RequestSignatureError,
    StaleSignedRequestError,
)
from pipeline.settings import PRIORITIES, TIERS
from pipeline.terms import Priority, Tier

if TYPE_CHECKING:
    from pipeline.records import InferenceRequest
    from pipeline.settings import Settings

#: priorities, highest first (the order of the work topics)
PRIORITY_ORDER: tuple[str, ...] = tuple(PRIORITIES)
#: tiers, highest first
TIER_ORDER: tuple[str, ...] = tuple(reversed(TIERS))
DEFAULT_TIER = "standard"
DEFAULT_MAX_PRIORITY = "interactive"
DEFAULT_TENANT = "default"
#: longest user_id of a record (docs/architecture.md, "Records": string 1-128)
MAX_USER_ID_CHARS = 128
#: a tenant name: no ``/`` (the separator of :func:`tenant_user_id`) and no ``:`` or ``,`` (the list form)
TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: characters a key may hold (printable ASCII without the separators of the list form)
KEY_RE = re.compile(r"[\x21-\x7e]{1,256}")
#: the header of a signed record naming its key (:attr:`ApiKey.key_id`, never the key itself)
KEY_ID_HEADER = "surge-key-id"
#: the header of a signed record holding the hex HMAC-SHA256 of its value, the key as secret
SIGNATURE_HEADER = "surge-signature"
SIGNATURE_HEADERS = (KEY_ID_HEADER, SIGNATURE_HEADER)
#: the header of a reply to a signed request: the hex HMAC-SHA256 of :data:`REPLY_LABEL` + the
#: reply's value, with the request's key as secret (:func:`sign_reply`); beside ``surge-key-id``
REPLY_SIGNATURE_HEADER = "surge-reply-signature"
#: what a reply's signature covers before its value: a reply's signature never passes for a
#: request's, nor a request's for a reply's
REPLY_LABEL = b"surge-reply\n"
#: the key id of the risk workers' escalation requests (:func:`escalation_signer`); a configured
#: key's id always starts with ``key-``, so the two never meet
ESCALATION_KEY_ID = "escalation"
#: what a key id looks like (shown in an error only when it has this form: a client that put its
#: key in the header by mistake must not find it in a reply or a dead letter)
KEY_ID_RE = re.compile(r"key-[0-9a-f]{16}|" + ESCALATION_KEY_ID)
#: how to sign, for the error of a record that is not signed right
HOW_TO_SIGN = (
    f"sign each record with an API key: header {KEY_ID_HEADER!r} = 'key-' + the first 16 hex digits "
    f"of sha256(key), header {SIGNATURE_HEADER!r} = the hex HMAC-SHA256 of the record's value, as "
    "sent, with the key as secret (README, 'Security')"
)
#: the label the escalation signer's secret is derived under (never the escalation key itself: that
#: one derives request ids, and one secret serves one purpose)
_ESCALATION_LABEL = b"surge request signature v1"
#: Kafka record headers as clients hand them over: (name, value) pairs (aiokafka, Faust) or a mapping
Headers = Iterable[Any] | Mapping[Any, Any] | None


def _digest(key: str) -> bytes:
    # surrogateescape: a header that is not valid UTF-8 still hashes (and matches nothing)
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class ApiKey:
    """One configured key: its tenant, its tier and the highest priority it may ask for."""

    key: str = field(repr=False)
    tenant: str = DEFAULT_TENANT
    tier: str = DEFAULT_TIER
    max_priority: str = DEFAULT_MAX_PRIORITY
    #: the id an internal signer's records name (:data:`ESCALATION_KEY_ID`); empty for a configured
    #: key, whose id derives from the key (:attr:`key_id`)
    signer_id: str = ""

    @property
    def key_user(self) -> str:
        """A user name derived from the key (a hash: the key itself never goes to Kafka)."""
        if not self.key:
            return "anonymous"
        return "key-" + hashlib.sha256(self.key.encode()).hexdigest()[:16]

    @property
    def key_id(self) -> str:
        """What a record signed with this key names in ``surge-key-id``: :attr:`key_user` (a hash of
        the key) for a configured key, :attr:`signer_id` for an internal signer."""
        return self.signer_id or self.key_user

    def grant(self, tier: str | None, priority: str | None) -> tuple[str, str]:
        """``(tier, priority)`` of a request that asked for these (None: the key's own).

        Lower than the key's is allowed; higher raises :class:`PermissionDeniedError` naming both.
        """
        tier = tier or self.tier
        priority = priority or self.max_priority
        if TIER_ORDER.index(tier) < TIER_ORDER.index(self.tier):
            raise PermissionDeniedError("tier", tier, self.tier, TIER_ORDER)
        if PRIORITY_ORDER.index(priority) < PRIORITY_ORDER.index(self.max_priority):
            raise PermissionDeniedError("priority", priority, self.max_priority, PRIORITY_ORDER)
        return tier, priority


#: what a gateway without configured keys grants every caller (development only)
ANONYMOUS = ApiKey(key="", tenant=DEFAULT_TENANT, tier=DEFAULT_TIER, max_priority=DEFAULT_MAX_PRIORITY)


def _entry(index: int, key: Any, tenant: Any, tier: Any, max_priority: Any) -> ApiKey:
    where = f"SURGE_API_KEYS entry {index + 1}"
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ApiKeyConfigError(f"{where}: a key must be 1-256 printable ASCII characters without spaces")
    tenant = tenant or DEFAULT_TENANT
    if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
        raise ApiKeyConfigError(
            f"{where}: tenant {str(tenant)[:70]!r} must be 1-64 characters of A-Z a-z 0-9 . _ -"
        )
    tier = tier or DEFAULT_TIER
    if tier not in TIER_ORDER:
        raise ApiKeyConfigError(f"{where}: tier {str(tier)[:40]!r} must be one of {list(TIER_ORDER)}")
    max_priority = max_priority or DEFAULT_MAX_PRIORITY
    if max_priority not in PRIORITY_ORDER:
        raise ApiKeyConfigError(
            f"{where}: max_priority {str(max_priority)[:40]!r} must be one of {list(PRIORITY_ORDER)}"
        )
    return ApiKey(key=key, tenant=tenant, tier=tier, max_priority=max_priority)


def _from_json(text: str) -> list[ApiKey]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ApiKeyConfigError(f"SURGE_API_KEYS looks like JSON but does not parse: {exc}") from exc
    if isinstance(data, dict):
        rows = [{"key": k, **(v if isinstance(v, dict) else {"tenant": v})} for k, v in data.items()]
    elif isinstance(data, list):
        rows = data
    else:
        raise ApiKeyConfigError(f"SURGE_API_KEYS JSON must be a list or an object, got {type(data).__name__}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ApiKeyConfigError(
                f"SURGE_API_KEYS entry {i + 1} must be an object, got {type(row).__name__}"
            )
        unknown = set(row) - {"key", "tenant", "tier", "max_priority"}
        if unknown:
            raise ApiKeyConfigError(f"SURGE_API_KEYS entry {i + 1}: unknown fields {sorted(unknown)}")
        out.append(_entry(i, row.get("key"), row.get("tenant"), row.get("tier"), row.get("max_priority")))
    return out


def _from_list(text: str) -> list[ApiKey]:
    out = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        fields = [f.strip() for f in part.split(":")]
        if len(fields) > 4:
            raise ApiKeyConfigError(
                f"SURGE_API_KEYS entry {i + 1} has {len(fields)} fields; the form is "
                "key:tenant[:tier[:max_priority]]"
            )
        key, tenant, tier, max_priority = (fields + [""] * 4)[:4]
        out.append(_entry(i, key, tenant, tier, max_priority))
    return out


def parse_api_keys(text: str) -> tuple[ApiKey, ...]:
    """The keys of ``SURGE_API_KEYS`` (JSON or the comma list); raises :class:`ApiKeyConfigError`.

    Messages name the entry by position, never the key itself (it would end up in logs).
    """
    text = text.strip()
    if not text:
        return ()
    keys = _from_json(text) if text[0] in "[{" else _from_list(text)
    seen: set[bytes] = set()
    for i, k in enumerate(keys):
        d = _digest(k.key)
        if d in seen:
            raise ApiKeyConfigError(f"SURGE_API_KEYS entry {i + 1} repeats an earlier key")
        seen.add(d)
    return tuple(keys)


class KeyRing:
    """The configured keys, looked up in constant time.

    Each presented key is hashed (SHA-256) and compared with :func:`hmac.compare_digest` against the
    digest of every configured key, without stopping at a match: the time taken depends neither on
    which key matched, nor on how much of a key was right, nor on its length.
    """

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self._entries: tuple[tuple[bytes, ApiKey], ...] = tuple((_digest(k.key), k) for k in keys)
        self._by_id: dict[str, ApiKey] = {}
        for _, k in self._entries:
            self._by_id.setdefault(k.key_id, k)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, presented: str) -> ApiKey | None:
        """The key's configuration, or None when ``presented`` is not a configured key."""
        digest = _digest(presented)
        found: ApiKey | None = None
        for known, key in self._entries:
            if hmac.compare_digest(known, digest) and found is None:
                found = key
        return found

    def by_id(self, key_id: str) -> ApiKey | None:
        """The key a signed record names (ids are hashes, not secrets: a plain lookup)."""
        return self._by_id.get(key_id)

    def verify(self, headers: Headers, value: bytes | None) -> ApiKey:
        """The key that signed a record of ``value`` with ``headers``; raises
        :class:`RequestSignatureError` saying what is wrong (no headers, a header repeated or missing,
        an unknown key id, a signature that does not match the value) and how to sign.

        The signature is compared with :func:`hmac.compare_digest`; nothing of a key appears in a
        message (an id is shown only when it has the form of one)."""
        raw_id, presented = signature_headers(headers)
        key_id = raw_id.decode("ascii", "replace")
        key = self.by_id(key_id)
        if key is None:
            shown = repr(key_id) if KEY_ID_RE.fullmatch(key_id) else "(not of the form key-<16 hex digits>)"
            raise RequestSignatureError(
                f"unknown key id {shown} in header {KEY_ID_HEADER!r}: no configured API key has it; "
                + HOW_TO_SIGN
            )
        expected = signature(key.key, value or b"").encode("ascii")
        if not hmac.compare_digest(expected, presented.strip().lower()):
            raise RequestSignatureError(
                f"the signature in header {SIGNATURE_HEADER!r} does not match the record's value for key "
                f"id {key_id!r} (a value changed after signing, or signed with another key); " + HOW_TO_SIGN
            )
        return key


def signature(secret: str, value: bytes) -> str:
    """The hex HMAC-SHA256 of ``value`` with ``secret`` (an API key) as the HMAC key."""
    return hmac.new(secret.encode("utf-8"), value, hashlib.sha256).hexdigest()


def sign(key: ApiKey, value: bytes) -> list[tuple[str, bytes]]:
    """The two headers of a record of ``value`` signed with ``key``: its id and the signature over the
    exact value bytes (any change to them, a re-encoding included, breaks it)."""
    if not key.key:
        raise ValueError("the anonymous key cannot sign: configure API keys (SURGE_API_KEYS)")
    return [
        (KEY_ID_HEADER, key.key_id.encode("ascii")),
        (SIGNATURE_HEADER, signature(key.key, value).encode("ascii")),
    ]


def reply_signature(secret: str, value: bytes) -> str:
    """The hex HMAC-SHA256 of :data:`REPLY_LABEL` + ``value`` with ``secret`` as the HMAC key."""
    return signature(secret, REPLY_LABEL + value)


def sign_reply(key: ApiKey, value: bytes) -> list[tuple[str, bytes]]:
    """The two headers of a reply of ``value`` to a request signed with ``key``: the key's id and
    :func:`reply_signature`. Only a holder of the key (the client that signed the request, and the
    workers) can make them: a reply that another tenant's request caused to be written to this
    client's topic, under its request id, carries that tenant's key and fails :func:`reply_signed_by`
    (docs/architecture.md, "Tenant isolation")."""
    return [
        (KEY_ID_HEADER, key.key_id.encode("ascii")),
        (REPLY_SIGNATURE_HEADER, reply_signature(key.key, value).encode("ascii")),
    ]


def reply_signed_by(key: ApiKey, headers: Headers, value: bytes | None) -> bool:
    """Whether a reply of ``value`` with ``headers`` was signed with ``key`` (:func:`sign_reply`):
    each header once, the key's id, the signature over these exact bytes (compared in constant
    time). False for anything else, a missing or repeated header included."""
    found: dict[str, list[Any]] = {KEY_ID_HEADER: [], REPLY_SIGNATURE_HEADER: []}
    for name, raw in _pairs(headers):
        n = _name(name)
        if n in found:
            found[n].append(raw)
    if any(len(v) != 1 or not isinstance(v[0], bytes | bytearray) for v in found.values()):
        return False
    if bytes(found[KEY_ID_HEADER][0]) != key.key_id.encode("ascii"):
        return False
    expected = reply_signature(key.key, value or b"").encode("ascii")
    return hmac.compare_digest(expected, bytes(found[REPLY_SIGNATURE_HEADER][0]).strip().lower())


def resign(headers: Headers, key: ApiKey, value: bytes) -> list[tuple[str, bytes]]:
    """``headers`` with the signature headers replaced by ``key``'s signature of ``value``: a copy
    of a record whose value was rewritten (pipeline/replay/plan.py), other headers kept in order."""
    kept = [(n, v) for n, v in _pairs(headers) if _name(n) not in SIGNATURE_HEADERS]
    return [*kept, *sign(key, value)]


def _pairs(headers: Headers) -> list[tuple[Any, Any]]:
    """``headers`` as (name, value) pairs; anything that is not a pair is dropped."""
    if headers is None:
        return []
    items = headers.items() if isinstance(headers, Mapping) else headers
    out = []
    for item in items:
        if isinstance(item, tuple | list) and len(item) == 2:
            out.append((item[0], item[1]))
    return out


def header_list(headers: Headers) -> list[tuple[str, bytes]] | None:
    """``headers`` as the (str, bytes) pairs a producer sends (a forwarded record keeps them), or None
    when there are none; a pair of any other types is dropped."""
    out = [
        (n, bytes(v)) for n, v in _pairs(headers) if isinstance(n, str) and isinstance(v, bytes | bytearray)
    ]
    return out or None


def _name(name: object) -> str:
    """A header's name, lower case (``Surge-Key-Id`` counts as a second ``surge-key-id``)."""
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    return name.lower() if isinstance(name, str) else ""


def signature_headers(headers: Headers) -> tuple[bytes, bytes]:
    """``(key id, signature)`` of a record; :class:`RequestSignatureError` when either is missing,
    repeated (names compared without case) or not bytes. A hostile producer chooses every header:
    none is trusted to be well-formed."""
    found: dict[str, list[Any]] = {name: [] for name in SIGNATURE_HEADERS}
    for name, value in _pairs(headers):
        n = _name(name)
        if n in found:
            found[n].append(value)
    if not any(found.values()):
        raise RequestSignatureError(
            f"the record is not signed (no {KEY_ID_HEADER!r} or {SIGNATURE_HEADER!r} header), and this "
            "deployment serves only signed records from the request topic; " + HOW_TO_SIGN
        )
    out = []
    for name, values in found.items():
        if not values:
            raise RequestSignatureError(f"the record has no {name!r} header; " + HOW_TO_SIGN)
        if len(values) > 1:
            raise RequestSignatureError(
                f"the record has {len(values)} {name!r} headers; a signed record carries each header once"
            )
        if not isinstance(values[0], bytes | bytearray) or not values[0]:
            raise RequestSignatureError(f"header {name!r} must hold bytes, got an empty or null value")
        out.append(bytes(values[0]))
    return out[0], out[1]


def authorize(req: InferenceRequest, key: ApiKey) -> InferenceRequest:
    """``req`` as a record signed with ``key`` is served: as the key's tenant, with the tier and
    priority the key grants (:meth:`ApiKey.grant`: what the record asks, if lower, else the key's own).

    Raises :class:`InvalidRequestError` (the reply's code; the record format has no other for this)
    when the record names another tenant (naming both), or a tier or priority above its key's. A
    field the record leaves out is the key's; the reply-book digest is unchanged (it covers what is
    asked, not who asks)."""
    given = req.model_fields_set
    if "tenant" in given and req.tenant != key.tenant:
        raise InvalidRequestError(
            f"tenant {req.tenant[:80]!r} is not the tenant of the signing key ({key.tenant!r}); leave "
            f"tenant out or name {key.tenant!r}"
        )
    try:
        tier, priority = key.grant(
            req.tier.value if "tier" in given else None, req.priority.value if "priority" in given else None
        )
    except PermissionDeniedError as exc:
        raise InvalidRequestError(exc.message) from exc
    return req.model_copy(update={"tenant": key.tenant, "tier": Tier(tier), "priority": Priority(priority)})


def check_signed_date(created_at_ms: int | None, record_ms: int, max_age_ms: int) -> None:
    """Refuse a signed request that its signature does not date, or dates too far from when the
    broker appended its record (``record_ms``: the request topic stamps each record with the broker's
    time, ``LogAppendTime``, which no producer chooses). A signed record copied off the topic and
    written again later keeps its signature and its ``created_at``, but gets a new append time: past
    ``max_age_ms`` it is refused, and within it the reply book (which keeps a reply longer) answers it
    with the reply already given. ``max_age_ms`` 0: no limit, ``created_at`` not required.

    Raises :class:`InvalidRequestError` for a signed request without ``created_at`` and
    :class:`StaleSignedRequestError` (naming both times and the limit) for one dated more than
    ``max_age_ms`` before or after its record."""
    if max_age_ms <= 0:
        return
    if created_at_ms is None:
        raise InvalidRequestError(
            "a signed request must carry created_at (epoch ms, when it was made): the signature then "
            "dates the record, and a copy of it written again later is refused"
        )
    if abs(record_ms - created_at_ms) > max_age_ms:
        raise StaleSignedRequestError(created_at_ms, record_ms, max_age_ms)


def escalation_signer(secret: str, tenant: str) -> ApiKey:
    """The signer of the risk workers' escalation requests: tenant ``tenant`` (the setting
    ``risk_escalation_tenant``), tier premium, priority up to realtime; its secret is derived from the
    escalation key (the same on every worker), so the request workers holding that key verify it."""
    derived = hmac.new(secret.encode("utf-8"), _ESCALATION_LABEL, hashlib.sha256).hexdigest()
    return ApiKey(
        key=derived,
        tenant=tenant,
        tier=Tier.PREMIUM.value,
        max_priority=Priority.REALTIME.value,
        signer_id=ESCALATION_KEY_ID,
    )


def escalation_signer_of(settings: Settings) -> ApiKey | None:
    """The escalation signer of ``settings``, or None without ``risk_escalation_key``."""
    if settings.risk_escalation_key is None:
        return None
    return escalation_signer(settings.risk_escalation_key.get_secret_value(), settings.risk_escalation_tenant)


def request_signers(settings: Settings) -> KeyRing | None:
    """Who may sign a record on the request topic: every configured API key, and the escalation
    signer when the escalation key is set (the intake's, a replay's and a shadow's ring; the gateway's
    has only the configured keys). None where records are taken as written (``kafka_request_auth``
    open, or auto without keys)."""
    if not settings.requests_signed:
        return None
    keys = list(parse_api_keys(settings.api_keys))
    escalation = escalation_signer_of(settings)
    if escalation is not None:
        keys.append(escalation)
    return KeyRing(keys)


def tenant_user_id(tenant: str, user: str) -> str:
    """The record's user_id of a tenant's user: ``<tenant>/<user>``.

    Tenant names hold no ``/``, so two tenants never produce the same user_id; rate-limit buckets,
    which are keyed by user_id, are then per tenant and user. Raises :class:`InvalidRequestError`
    when the result would exceed the record's 128 characters.
    """
    uid = f"{tenant}/{user}"
    if len(uid) > MAX_USER_ID_CHARS:
        raise InvalidRequestError(
            f"user must be at most {MAX_USER_ID_CHARS - len(tenant) - 1} characters for tenant "
            f"{tenant!r} (user_id '<tenant>/<user>' is at most {MAX_USER_ID_CHARS}), got {len(user)}"
        )
    return uid
