"""Every metric surge exports (docs/architecture.md, "Metrics"), created in one factory that takes
the registry.

Tests pass their own :class:`CollectorRegistry`; a worker uses one per process and serves it at
``/metrics``. prometheus-client appends ``_total`` to counter names in the exposition.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.gcpause import GENERATIONS, GcPauseTimer
from pipeline.terms import PRIORITIES

LATENCY_BUCKETS_S = (0.1, 0.5, 1.0, 2.0, 5.0)
REQUEST_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FILL_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
#: one garbage collection's pause: a young one takes well under a millisecond, a full one over a heap
#: that is not frozen a few hundred
GC_PAUSE_BUCKETS_S = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0)

#: names as they appear in the exposition (what deploy/ and the benchmarks read)
METRIC_NAMES = (
    "model_inference_latency",
    "gpu_utilization",
    "requests_queue_depth",
    "requests_in_queue_per_worker",
    "surge_requests_total",
    "surge_request_latency_seconds",
    "surge_deadline_missed_total",
    "surge_batch_size",
    "surge_batch_fill_ratio",
    "surge_cache_lookups_total",
    "surge_merged_total",
    "surge_degradation_level",
    "surge_rate_limited_total",
    "surge_deadletter_total",
    "surge_replies_repeated_total",
    "surge_embed_batch_size",
    "surge_gc_pause_seconds",
    *(
        "surge_risk_decision_latency_seconds",
        "surge_risk_decisions_total",
        "surge_risk_rule_hits_total",
        "surge_risk_late_events_total",
        "surge_risk_feature_cache_total",
        "surge_risk_escalations_total",
        "surge_risk_states_expired_total",
    ),
)
#: produce-to-decision latency of the risk path (its SLA is 200 ms, its target 100 ms)
RISK_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
RISK_OUTCOMES = ("approve", "review", "decline", "error")


@dataclass(frozen=True)
class RiskMetrics:
    """The risk path's metrics (docs/architecture.md, "Risk: operation")."""

    decision_latency: Histogram
    decisions: Counter
    rule_hits: Counter
    late_events: Counter
    feature_cache: Counter
    escalations: Counter
    states_expired: Counter


def create_risk_metrics(r: CollectorRegistry) -> RiskMetrics:
    """The risk metrics in ``r``, with zero-valued children for the fixed label values."""
    from pipeline.risk.records import ENTITY_KINDS
    from pipeline.risk.rules import DEFAULT_RULES

    m = RiskMetrics(
        decision_latency=Histogram(
            "surge_risk_decision_latency_seconds",
            "Seconds from an event's produce time to its decision",
            buckets=RISK_LATENCY_BUCKETS_S,
            registry=r,
        ),
        decisions=Counter("surge_risk_decisions", "Risk decisions sent", ["decision"], registry=r),
        rule_hits=Counter("surge_risk_rule_hits", "Risk rules that fired", ["rule"], registry=r),
        late_events=Counter(
            "surge_risk_late_events",
            "Risk events later than the grace period (sent to surge.risk.late)",
            registry=r,
        ),
        feature_cache=Counter(
            "surge_risk_feature_cache",
            "Entity state reads, by whether the feature cache served them",
            ["kind", "result"],
            registry=r,
        ),
        escalations=Counter(
            "surge_risk_escalations",
            "Borderline risk decisions put to the model path, by how the escalation ended "
            "(unknown_reply: a reply on the escalation topic that no escalation waits for, or one not "
            "signed by the escalation signer)",
            ["outcome"],
            registry=r,
        ),
        states_expired=Counter(
            "surge_risk_states_expired",
            "Entity states not changed for SURGE_RISK_STATE_TTL_S: found expired when read (the "
            "entity starts again empty), or deleted by the sweep",
            ["kind", "how"],
            registry=r,
        ),
    )
    from pipeline.risk.escalation import OUTCOMES

    for outcome in (*OUTCOMES, "unknown_reply"):
        m.escalations.labels(outcome=outcome)
    for outcome in RISK_OUTCOMES:
        m.decisions.labels(decision=outcome)
    for rule in DEFAULT_RULES:
        m.rule_hits.labels(rule=rule.rule_id)
    for kind in ENTITY_KINDS:
        for result in ("hit", "miss"):
            m.feature_cache.labels(kind=kind, result=result)
        for how in ("read", "swept"):
            m.states_expired.labels(kind=kind, how=how)
    return m


@dataclass(frozen=True)
class Metrics:
    model_inference_latency: Histogram
    gpu_utilization: Gauge
    requests_queue_depth: Gauge
    requests_in_queue_per_worker: Gauge
    requests: Counter
    request_latency: Histogram
    deadline_missed: Counter
    batch_size: Histogram
    batch_fill_ratio: Histogram
    cache_lookups: Counter
    merged: Counter
    degradation_level: Gauge
    rate_limited: Counter
    deadletter: Counter
    replies_repeated: Counter
    embed_batch_size: Histogram
    gc_pause: Histogram
    risk: RiskMetrics
    registry: CollectorRegistry


def create_metrics(registry: CollectorRegistry | None = None) -> Metrics:
    """Create every surge metric in ``registry`` (a fresh one when None)."""
    r = registry if registry is not None else CollectorRegistry()
    m = Metrics(
        model_inference_latency=Histogram(
            "model_inference_latency",
            "Seconds of one model call",
            ["model_version"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        ),
        gpu_utilization=Gauge("gpu_utilization", "GPU utilisation, percent", ["device_id"], registry=r),
        requests_queue_depth=Gauge(
            "requests_queue_depth", "Items waiting in the inference queue", ["priority"], registry=r
        ),
        requests_in_queue_per_worker=Gauge(
            "requests_in_queue_per_worker",
            "Items waiting in this worker's queue (the HPA signal)",
            registry=r,
        ),
        requests=Counter("surge_requests", "Replies sent", ["priority", "status", "served_from"], registry=r),
        request_latency=Histogram(
            "surge_request_latency_seconds",
            "Seconds from created_at to reply",
            ["priority"],
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        ),
        deadline_missed=Counter(
            "surge_deadline_missed", "Requests that missed their deadline", ["priority"], registry=r
        ),
        batch_size=Histogram(
            "surge_batch_size", "Items per model call", buckets=BATCH_SIZE_BUCKETS, registry=r
        ),
        batch_fill_ratio=Histogram(
            "surge_batch_fill_ratio", "Batch size / batch limit at flush", buckets=FILL_BUCKETS, registry=r
        ),
        cache_lookups=Counter("surge_cache_lookups", "Answer cache lookups", ["layer", "result"], registry=r),
        merged=Counter("surge_merged", "Requests answered by another request's model call", registry=r),
        degradation_level=Gauge("surge_degradation_level", "Current degradation level 0-3", registry=r),
        rate_limited=Counter(
            "surge_rate_limited", "Requests refused by a token bucket", ["scope"], registry=r
        ),
        deadletter=Counter("surge_deadletter", "Dead-letter records written", ["reason"], registry=r),
        replies_repeated=Counter(
            "surge_replies_repeated", "Recorded replies sent again for a request read again", registry=r
        ),
        embed_batch_size=Histogram(
            "surge_embed_batch_size",
            "Questions per embedding call",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        ),
        gc_pause=Histogram(
            "surge_gc_pause_seconds",
            "Seconds the process stood still for one garbage collection",
            ["generation"],
            buckets=GC_PAUSE_BUCKETS_S,
            registry=r,
        ),
        risk=create_risk_metrics(r),
        registry=r,
    )
    # children for the fixed label values, so that rates and alerts see zeros instead of nothing
    for priority in PRIORITIES:
        m.deadline_missed.labels(priority=priority)
        m.requests_queue_depth.labels(priority=priority).set(0)
        m.request_latency.labels(priority=priority)
    for scope in ("user", "tenant"):
        m.rate_limited.labels(scope=scope)
    for generation in GENERATIONS:
        m.gc_pause.labels(generation=str(generation))
    for layer in ("exact", "semantic"):
        for result in ("hit", "miss"):
            m.cache_lookups.labels(layer=layer, result=result)
    return m


def gc_pause_timer(metrics: Metrics) -> GcPauseTimer:
    """A :class:`pipeline.gcpause.GcPauseTimer` observing into ``surge_gc_pause_seconds`` through the
    children made in :func:`create_metrics` (no ``labels()`` call inside the collector)."""
    children = {g: metrics.gc_pause.labels(generation=str(g)) for g in GENERATIONS}

    def observe(generation: int, seconds: float) -> None:
        child = children.get(generation)
        if child is not None:
            child.observe(seconds)

    return GcPauseTimer(observe)


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus exposition text (a worker's /metrics) → ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


class GpuSampler:
    """Reads GPU utilisation through NVML into ``gpu_utilization``; does nothing without a GPU."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.handles: list[object] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            self.handles = []

    def sample(self) -> None:
        for i, h in enumerate(self.handles):
            util = self._nvml.nvmlDeviceGetUtilizationRates(h)
            self.metrics.gpu_utilization.labels(device_id=str(i)).set(util.gpu)
