"""Every metric docs/architecture.md lists and deploy/ reads is exported by a live worker's /metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.metrics import METRIC_NAMES, GpuSampler, create_metrics
from tests.conftest import RELAXED, request
from tests.deploy_metrics import DESIGN_METRICS, deploy_metric_references, documented_metrics

pytestmark = pytest.mark.integration


def test_the_factory_creates_every_documented_metric_in_the_given_registry() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    create_metrics(registry)
    exported = {
        fam.name + ("_total" if fam.type == "counter" else ""): fam.type for fam in registry.collect()
    }
    assert exported == documented_metrics(), "the factory's names and types must be the documented ones"
    assert set(METRIC_NAMES) == set(exported)
    assert DESIGN_METRICS.items() <= exported.items(), "deploy/ relies on a metric the factory lacks"


async def test_live_scrape_exports_every_metric_deploy_reads(deployment) -> None:
    d = deployment(model="echo", user_rate_per_s_standard="1", user_burst_standard="2", **RELAXED)
    w = d.worker()
    c = await d.client()
    futs = [await c.submit(request(i, "metrics-user", "what is my balance")) for i in range(4)]
    await c.send_raw(b"metrics-user", b"not json")
    await c.producer.flush()
    await d.replies(futs, 60)
    await asyncio.sleep(0.5)
    text = w.metrics()
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    has_gpu = bool(GpuSampler(create_metrics()).handles)
    missing = {
        name
        for name in deploy_metric_references()
        if name not in samples and not (name == "gpu_utilization" and not has_gpu)
    }
    assert not missing, f"deploy/ reads metrics the worker does not export: {sorted(missing)}"
    assert "gpu_utilization" not in samples or has_gpu, "gpu_utilization must be absent on CPU"
