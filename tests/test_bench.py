"""The benchmarks keep working: each scenario in ``--quick`` mode against the real broker.

These assert that every arm ran and that the numbers are sane (everything answered, positive
throughputs, ordered percentiles, plausible counts), never the performance targets: quick runs on a
shared 2-core box are too small and too noisy for that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.bench import SCENARIOS, run_bench
from pipeline.bench.common import BenchError, target
from pipeline.bench.merging import build_workload, light_edit
from pipeline.broker import EmbeddedKafka
from pipeline.dedup import normalize
from pipeline.stats import percentile
from tests.conftest import SHARED_DATA

BANKING77 = SHARED_DATA / "banking77" / "train.csv"


def _run(scenario: str, kafka: EmbeddedKafka, tmp_path: Path, **options: Any) -> dict[str, Any]:
    out = tmp_path / f"{scenario}.json"
    rc = run_bench(scenario, quick=True, json_path=out, broker=kafka, **options)
    assert rc == 0
    assert out.with_suffix(".png").stat().st_size > 1000, "the plot was written"
    result = json.loads(out.read_text())
    assert result["scenario"] == scenario and result["quick"] is True
    for t in result["targets"]:
        assert set(t) >= {"name", "value", "goal", "met", "missed_by"}
        assert t["met"] or t["missed_by"] is None or t["missed_by"] > 0
    return result


def _sane_latency(lat: dict[str, Any]) -> None:
    assert lat["count"] > 0
    assert 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["p999_ms"] <= lat["max_ms"]


# ---- pure helpers (no broker) -------------------------------------------------------------------
def test_percentile_interpolates_and_target_reports_the_shortfall() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99.0
    import pipeline.bench.common
    import pipeline.demo

    assert pipeline.demo.percentile is pipeline.bench.common.percentile is percentile  # one definition
    missed = target("x", 0.3, ">=", 0.5)
    assert missed["met"] is False and missed["missed_by"] == pytest.approx(0.2)
    met = target("y", 120.0, "<=", 200.0)
    assert met["met"] is True and met["missed_by"] == 0.0


def test_merging_workload_has_the_requested_mix_and_edits_keep_the_intent() -> None:
    rows = [(f"How do I do thing number {i} with my card?", f"intent_{i % 7}") for i in range(400)]
    items = build_workload(rows, 100)
    kinds = [it.kind for it in items]
    assert len(items) == 200
    assert kinds.count("unique") == 100 and kinds.count("repeat") == 60 and kinds.count("edit") == 40
    for i, it in enumerate(items):
        if it.kind != "unique":
            assert it.source is not None and it.source < i, "a copy follows its original"
            assert items[it.source].kind == "unique" and it.intent == items[it.source].intent
        if it.kind == "repeat":
            assert it.text == items[it.source].text
    assert len({normalize(it.text) for it in items if it.kind == "unique"}) == 100


def test_light_edit_changes_only_surface_form() -> None:
    import random

    rng = random.Random(3)
    base = "Why was my card payment declined?"
    edits = {light_edit(base, rng) for _ in range(50)}
    assert len(edits) > 5
    for e in edits:
        assert "declined" in e.lower() and "card" in e.lower()


def test_merging_fails_clearly_without_the_data(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="banking77 CSV not found"):
        run_bench("merging", quick=True, json_path=tmp_path / "m.json", banking77_csv=tmp_path / "nope.csv")


def test_unknown_scenario_is_refused() -> None:
    with pytest.raises(ValueError, match="one of batching"):
        run_bench("speed", quick=True)
    assert SCENARIOS == ("batching", "merging", "priority", "overhead", "gateway")


# ---- quick runs against the real broker -----------------------------------------------------------
@pytest.mark.integration
def test_overhead_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("overhead", kafka, tmp_path)
    for arm in ("surge", "plain"):
        a = r["arms"][arm]
        assert a["answered"] == a["sent"] > 0 and a["errors"] == 0 and a["lost"] == 0
        assert a["throughput_rps"] > 0
        _sane_latency(a["latency_idle"])
    assert r["throughput_ratio_surge_vs_plain"] > 0
    assert r["added_p50_latency_ms"] is not None


@pytest.mark.integration
def test_batching_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("batching", kafka, tmp_path)
    assert set(r["arms"]) == {"surge", "surge_b1", "limit"}
    for arm in ("surge", "surge_b1"):
        a = r["arms"][arm]
        assert a["answered"] == a["sent"] > 0 and a["errors"] == 0
        _sane_latency(a["latency"])
    assert r["arms"]["surge_b1"]["mean_batch_size"] == 1.0, "batch size one means one request per call"
    assert r["arms"]["surge"]["mean_batch_size"] > 1.0
    assert r["arms"]["limit"]["throughput_rps"] > 0
    assert r["throughput_ratio_surge_vs_b1"] > 0 and r["throughput_ratio_surge_vs_limit"] > 0


@pytest.mark.integration
@pytest.mark.skipif(not BANKING77.is_file(), reason="banking77 data not present")
def test_merging_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("merging", kafka, tmp_path, banking77_csv=BANKING77)
    on, off = r["arms"]["surge"], r["arms"]["off"]
    n = r["data"]["requests"]
    for a in (on, off):
        assert a["answered"] == a["sent"] == n and a["errors"] == 0
    assert off["model_items"] == n, "with merging and caching off every request reaches the model"
    assert off["served_from"] == {"model": n}
    assert on["model_items"] == on["served_from"].get("model", 0) < n
    assert sum(on["served_from"].values()) == n
    assert on["merged_pairs_checked"] + on["merged_pairs_unverifiable"] == n - on["model_items"]
    assert 0 < r["model_calls_saved"] <= r["model_calls_saved_best_possible"] + 1e-9
    assert 0 <= on["wrong_intent_rate"] <= 1


@pytest.mark.integration
def test_priority_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("priority", kafka, tmp_path)
    assert r["capacity_rps"] > 0
    for arm in ("edf", "fifo"):
        a = r["arms"][arm]
        assert a["offered_rps"] == pytest.approx(1.5 * r["capacity_rps"], rel=0.01)
        assert a["answered"] == a["sent"] > 0
        classes = a["classes"]
        assert set(classes) == {"realtime", "interactive", "batch"}
        assert sum(c["sent"] for c in classes.values()) == a["sent"]
        assert 0.05 < classes["realtime"]["sent"] / a["sent"] < 0.16
        for c in classes.values():
            assert c["misses"] == c["deadline_exceeded"] + c["late_ok"] + c["lost"]
            assert 0 <= c["miss_rate"] <= 1


@pytest.mark.integration
def test_gateway_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    pytest.importorskip("pipeline.gateway")
    r = _run("gateway", kafka, tmp_path)
    for arm in ("surge", "sync"):
        a = r["arms"][arm]
        assert a["requests"] > 0
        assert a["ok"] >= 0.9 * a["requests"], a["error_samples"]
        assert a["requests_per_s"] > 0
        _sane_latency(a["latency_ok"])
