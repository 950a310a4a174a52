"""Metric names that `deploy/` refers to, and the names docs/architecture.md documents.

The dashboard, the alert rules, the HPA and the prometheus-adapter rule all name metrics by string; a
renamed metric in the code silently empties a panel or disables an alert. These helpers pull every
referenced name out of those files so that tests can hold them against docs/architecture.md
("Metrics") and against a live `/metrics` scrape of a worker.

Called by tests only (tests/test_deploy.py, and the live scrape test).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

DEPLOY_DIR: Path = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD: Path = DEPLOY_DIR / "grafana" / "dashboards" / "surge.json"
ALERTS: Path = DEPLOY_DIR / "prometheus" / "alerts.yaml"
HPA: Path = DEPLOY_DIR / "k8s" / "hpa.yaml"
ADAPTER_VALUES: Path = DEPLOY_DIR / "k8s" / "prometheus-adapter-values.yaml"
ARCHITECTURE: Path = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

#: The metrics deploy/ relies on (each documented in docs/architecture.md, "Metrics"), in exposition
#: form (what a scrape of /metrics shows, before the `_bucket`/`_sum`/`_count` series of
#: histograms), with the metric type.
DESIGN_METRICS: dict[str, str] = {
    "model_inference_latency": "histogram",
    "gpu_utilization": "gauge",
    "requests_queue_depth": "gauge",
    "requests_in_queue_per_worker": "gauge",
    "surge_requests_total": "counter",
    "surge_request_latency_seconds": "histogram",
    "surge_deadline_missed_total": "counter",
    "surge_batch_size": "histogram",
    "surge_batch_fill_ratio": "histogram",
    "surge_cache_lookups_total": "counter",
    "surge_merged_total": "counter",
    "surge_degradation_level": "gauge",
    "surge_rate_limited_total": "counter",
    "surge_deadletter_total": "counter",
    "surge_risk_decision_latency_seconds": "histogram",
    "surge_risk_decisions_total": "counter",
    "surge_risk_rule_hits_total": "counter",
    "surge_risk_late_events_total": "counter",
    "surge_risk_feature_cache_total": "counter",
    "surge_risk_escalations_total": "counter",
    "surge_risk_states_expired_total": "counter",
    "surge_gc_pause_seconds": "histogram",
}


def documented_metrics() -> dict[str, str]:
    """``{name: type}`` of the table in docs/architecture.md, "Metrics"."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\|\s*`(\w+)`\s*\|\s*(\w+)", section, flags=re.MULTILINE))


#: Metrics that deploy/ reads from other exporters, and which exporter provides each.
EXTERNAL_METRICS: dict[str, str] = {
    "kafka_consumergroup_lag": "danielqsj/kafka_exporter (the kafka-exporter service in deploy/compose.yaml)",
}

HISTOGRAM_SUFFIXES: tuple[str, ...] = ("_bucket", "_sum", "_count")

_PROMQL_WORDS: frozenset[str] = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
    | {"offset", "inf", "nan", "atan2"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_TEMPLATE = re.compile(r"<<[^>]*>>")
_LABELS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(\s*\()?")


def promql_metric_names(expr: str) -> set[str]:
    """Return the metric names that a PromQL expression selects.

    Called on every `expr` of the dashboard and the alert rules and on the adapter's queries. It drops
    strings, label matchers, ranges, grouping clauses and prometheus-adapter's `<<.Series>>`
    placeholders, then keeps each identifier that is not a function call or a PromQL keyword.
    """
    text = _STRING.sub('""', expr)
    text = _TEMPLATE.sub(" ", text)
    text = _LABELS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names: set[str] = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _PROMQL_WORDS:
            continue
        names.add(name)
    return names


def base_metric_name(series: str) -> str:
    """Strip a histogram's `_bucket`/`_sum`/`_count` suffix: the name of the metric family."""
    for suffix in HISTOGRAM_SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def _walk(node: Any, key: str) -> Iterator[Any]:
    """Yield every value stored under `key` anywhere in a nested JSON/YAML structure."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, key)


def dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    """Every PromQL query of the Grafana dashboard's panels (rows included)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return [e for e in _walk(data.get("panels", []), "expr") if isinstance(e, str)]


def alert_exprs(path: Path = ALERTS) -> list[str]:
    """Every `expr` of the Prometheus alert and recording rules."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [rule["expr"] for group in data["groups"] for rule in group["rules"]]


def hpa_metric_names(path: Path = HPA) -> set[str]:
    """Custom metric names that the HorizontalPodAutoscalers ask the metrics APIs for."""
    names: set[str] = set()
    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if not doc or doc.get("kind") != "HorizontalPodAutoscaler":
            continue
        for metric in doc["spec"].get("metrics", []):
            source = metric.get(
                {"Pods": "pods", "Object": "object", "External": "external"}.get(metric["type"], "")
            )
            if source:
                names.add(source["metric"]["name"])
    return names


def adapter_metric_names(path: Path = ADAPTER_VALUES) -> set[str]:
    """Metric names in the prometheus-adapter rules: series queried and names served."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    rules = data.get("rules", {})
    for rule in [*rules.get("custom", []), *rules.get("external", [])]:
        names |= promql_metric_names(rule["seriesQuery"])
        names |= promql_metric_names(rule.get("metricsQuery", ""))
        name = rule.get("name", {})
        if "as" in name:
            names.add(name["as"])
        plain = name.get("matches", "").removeprefix("^").removesuffix("$")
        if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", plain):
            names.add(plain)
    return names


def _all_referenced(exprs: Iterable[str]) -> set[str]:
    names: set[str] = set()
    for expr in exprs:
        names |= promql_metric_names(expr)
    return names


def deploy_metric_references() -> set[str]:
    """Every surge series name that deploy/ reads, as it appears in a scrape (`_bucket` etc. kept).

    Metrics of other exporters (EXTERNAL_METRICS) are left out. The live scrape test checks that each
    of these series is present in a worker's /metrics output.
    """
    names = _all_referenced([*dashboard_exprs(), *alert_exprs()])
    names |= hpa_metric_names() | adapter_metric_names()
    return {n for n in names if n not in EXTERNAL_METRICS}


def deploy_metric_names() -> set[str]:
    """Every surge metric that deploy/ reads, as a metric family name (histogram suffixes stripped)."""
    return {base_metric_name(n) for n in deploy_metric_references()}


def external_metric_references() -> set[str]:
    """Metrics that deploy/ reads from exporters other than surge."""
    names = _all_referenced([*dashboard_exprs(), *alert_exprs()])
    return {n for n in names if n in EXTERNAL_METRICS}
