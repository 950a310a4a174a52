"""Typed errors of surge. Every error raised by surge derives from :class:`SurgeError`.

Each error carries the numbers that matter (queue depth and its limit, the deadline and how
late) so that an operator reading a reply or a log line knows what to change.
"""

from __future__ import annotations


class SurgeError(Exception):
    """Root of every error surge raises. ``code`` is the reply error code it maps to."""

    code: str = "internal"

    def __init__(self, message: str, *, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms


class InvalidRequestError(SurgeError):
    """A record that cannot be decoded or fails validation."""

    code = "invalid_request"


class StaleSignedRequestError(InvalidRequestError):
    """A signed request whose ``created_at`` lies further from the time the broker appended its
    record than signed requests may (a captured record written again later: docs/architecture.md,
    "Tenant isolation")."""

    def __init__(self, created_at_ms: int, record_ms: int, max_age_ms: int) -> None:
        gap_ms = record_ms - created_at_ms
        where = "before" if gap_ms > 0 else "after"
        super().__init__(
            f"signed request dated created_at={created_at_ms} lies {abs(gap_ms) / 1000:.1f} s {where} the "
            f"broker appended its record (at {record_ms}); a signed request is taken only within "
            f"{max_age_ms / 1000:g} s of its created_at (SURGE_SIGNED_REQUEST_MAX_AGE_S), so that a copy "
            "of it written again later is refused: sign a new record with a fresh created_at"
        )
        self.created_at_ms = created_at_ms
        self.record_ms = record_ms
        self.age_ms = gap_ms
        self.max_age_ms = max_age_ms


class RateLimitedError(SurgeError):
    """A token bucket (per user or per tenant) is empty."""

    code = "rate_limited"

    def __init__(self, scope: str, key: str, rate_per_s: float, burst: float, retry_after_ms: int) -> None:
        super().__init__(
            f"rate limit exceeded for {scope} {key!r}: {rate_per_s:g} requests/s, burst {burst:g}; "
            f"retry after {retry_after_ms} ms, under a new request_id (this refusal is this one's reply)",
            retry_after_ms=retry_after_ms,
        )
        self.scope = scope
        self.key = key
        self.rate_per_s = rate_per_s
        self.burst = burst


class OverloadedError(SurgeError):
    """A bounded queue is full."""

    code = "overloaded"

    def __init__(self, priority: str, depth: int, limit: int, retry_after_ms: int = 1000) -> None:
        super().__init__(
            f"{priority} queue is full: depth {depth}, limit {limit}", retry_after_ms=retry_after_ms
        )
        self.priority = priority
        self.depth = depth
        self.limit = limit


class DeadlineExceededError(SurgeError):
    """The deadline passed before inference began."""

    code = "deadline_exceeded"

    def __init__(self, deadline_ms: int, late_ms: int, priority: str) -> None:
        super().__init__(
            f"{priority} request missed its deadline of {deadline_ms} ms by {late_ms} ms "
            "before inference could begin"
        )
        self.deadline_ms = deadline_ms
        self.late_ms = late_ms
        self.priority = priority


class DeadlineUnreachableError(DeadlineExceededError):
    """Refused before its embedding: its class recently waited longer for the model than it has
    left, so it would expire in the queue (docs/architecture.md, "Degradation")."""

    def __init__(self, deadline_ms: int, left_ms: int, wait_ms: int, ahead_ms: int, priority: str) -> None:
        SurgeError.__init__(
            self,
            f"{priority} request cannot begin inference within its deadline of {deadline_ms} ms: "
            f"{left_ms} ms left, and {priority} requests waited {wait_ms} ms for the model lately, "
            f"after an embedding call of about {ahead_ms} ms",
        )
        self.deadline_ms = deadline_ms
        self.late_ms = 0
        self.left_ms = left_ms
        self.wait_ms = wait_ms
        self.ahead_ms = ahead_ms
        self.priority = priority


class SettingsError(SurgeError):
    """An invalid combination of settings; names both values."""


class BrokerError(SurgeError):
    """The embedded broker could not be resolved, started or reached."""


class TopicMissingError(BrokerError):
    """A client was asked to read a topic the cluster does not have (a worker creates surge's own
    topics when it starts)."""

    def __init__(self, kind: str, topic: str) -> None:
        super().__init__(
            f"{kind} {topic!r} does not exist on the cluster (a surge worker creates its topics when it starts)"
        )
        self.topic = topic


class ApiKeyConfigError(SettingsError):
    """``SURGE_API_KEYS`` does not parse; names the entry by position, never the key."""


class PermissionDeniedError(SurgeError):
    """A request asked for a tier or priority above what its API key allows."""

    code = "permission_denied"

    def __init__(self, what: str, asked: str, allowed: str, order: tuple[str, ...]) -> None:
        super().__init__(
            f"this API key may use {what} up to {allowed!r}, got {asked!r} "
            f"(highest first: {', '.join(order)}); ask for {allowed!r} or lower"
        )
        self.what = what
        self.asked = asked
        self.allowed = allowed


class RequestSignatureError(InvalidRequestError):
    """A record on the request topic without a valid signature, where requests must be signed
    (``kafka_request_auth``): says what is wrong and how to sign, never a key. Its reply code is
    ``invalid_request``, one of the codes the record format allows (docs/architecture.md, "Security")."""


class ModelError(SurgeError):
    """A model call failed for this input; permanent unless a subclass says otherwise.

    Defined here, not in ``models``, because the pipeline's core handles it (failure isolation, error
    replies) without importing any model backend; ``models.exceptions`` re-exports it.
    """

    code = "model_error"


class TransientModelError(ModelError):
    """A failure worth retrying with backoff (timeouts, 5xx from a remote endpoint, busy device)."""


class PartialBatchError(ModelError):
    """Some items of a batch failed on their own calls (after their retries) while the others were
    answered; ``results`` holds, per item in order, its output or its :class:`ModelError`. A backend
    whose items are separate calls (a remote endpoint) raises it, so that one request timing out
    fails alone instead of failing every batch-mate (docs/architecture.md, "The path of a request")."""

    def __init__(self, results: list[object]) -> None:
        failed = sum(1 for r in results if isinstance(r, ModelError))
        super().__init__(f"{failed} of {len(results)} items of the batch failed")
        self.results = results
        self.failed = failed
