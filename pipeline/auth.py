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
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.exceptions import ApiKeyConfigError, InvalidRequestError, PermissionDeniedError
from pipeline.settings import PRIORITIES, TIERS

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

    @property
    def key_user(self) -> str:
        """A user name derived from the key (a hash: the key itself never goes to Kafka)."""
        if not self.key:
            return "anonymous"
        return "key-" + hashlib.sha256(self.key.encode()).hexdigest()[:16]

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
