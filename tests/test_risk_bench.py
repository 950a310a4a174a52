"""``surge bench risk --quick`` runs end to end on the real broker and its numbers are sane (never its
performance targets: a quick run on a shared 2-core box is too small and too noisy for that), and the
packaged risk model loads, scores like scikit-learn would, and beats the rules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.risk import INPUTS, RiskModel, evaluate, evaluate_later_periods, replay, train, vectorize
from pipeline.devtools.bench import SCENARIOS, run_bench
from pipeline.devtools.broker import EmbeddedKafka
from pipeline.risk.features import OK, FeatureEngine
from pipeline.risk.simulate import DAY_MS, SimConfig, simulate
from pipeline.stats import recall_at_fpr


def test_recall_at_fpr_picks_the_strictest_threshold_within_the_rate() -> None:
    labels = [0] * 100 + [1] * 10
    scores = [i / 100 for i in range(100)] + [0.995] * 5 + [0.5] * 5
    r = recall_at_fpr(scores, labels, 0.01)
    assert r["recall"] == 0.5 and r["fpr"] == 0.01 and r["threshold"] == 0.99
    assert recall_at_fpr([1.0] * 110, labels, 0.01)["recall"] == 0.0  # every threshold flags all legit
    with pytest.raises(ValueError, match="both classes"):
        recall_at_fpr([0.1], [1])


def test_training_exports_trees_that_score_like_scikit_learn(tmp_path: Path) -> None:
    events = simulate(SimConfig(customers=300, days=6, seed=4, fraud_scale=6))
    model, report = train(events, n_estimators=30, progress=False)
    assert report["test_fraud"] > 10 and 0 <= report["model"]["recall"] <= 1
    assert model.meta["review_threshold"] <= model.meta["decline_threshold"]
    again = RiskModel.load(model.save(tmp_path / "m"))
    assert again.version == model.version and again.version.startswith("risk-gbt-")
    eng = FeatureEngine()
    rows = [(e, f) for e in events[:3000] if (r := eng.process(e))[0] == OK and (f := r[1]) is not None]
    X = np.asarray([vectorize(e, f) for e, f in rows], dtype=np.float32)
    assert X.shape[1] == len(INPUTS)
    assert np.allclose(again.proba(X), model.proba(X))
    assert again.score_many(rows[:5]) == [round(float(p), 6) for p in model.proba(X[:5])]
    # the contributions along the tree paths add up to the log-odds
    e, f = rows[0]
    total = sum(c for _, _, c in again.explain(e, f, top=len(INPUTS)))
    for name, value, _ in again.explain(e, f, top=3):
        assert value == float(np.float32(vectorize(e, f)[INPUTS.index(name)]))
    roots = float(again.value[again.roots].sum())
    assert again.base + roots + total == pytest.approx(float(again.raw(X[:1])[0]), abs=1e-3)
    # the exported trees are scikit-learn's trees
    from sklearn.ensemble import GradientBoostingClassifier

    from models.risk import _export

    rng = np.random.default_rng(0)
    Xr = rng.normal(size=(400, len(INPUTS))).astype(np.float32)
    yr = (Xr[:, 0] + Xr[:, 5] * Xr[:, 9] > 0.3).astype(int)
    gb = GradientBoostingClassifier(n_estimators=20, max_depth=3).fit(Xr, yr)
    assert np.allclose(_export(gb, {}).raw(Xr), gb.decision_function(Xr), atol=1e-9)
    with pytest.raises(Exception, match="no risk model"):
        RiskModel.load(tmp_path / "nothing")


def test_later_periods_are_scored_each_and_pooled(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Each seed's period is the simulation after the training period, scored after its warm-up days;
    the pooled report scores every period's events together; the CLI prints both."""
    model = RiskModel.load()
    res = evaluate_later_periods(model, [7, 3], customers=400, days=3, warm_days=1, progress=False)
    one, other = res["periods"]
    assert [one["period"]["seed"], other["period"]["seed"]] == [7, 3]
    # the seed-7 period, computed by hand: the world the model was trained on, after its training days
    start = int(model.meta["sim_config"]["start_ms"] + model.meta["sim_config"]["days"] * DAY_MS)
    X, y, times, rows = replay(simulate(SimConfig(customers=400, days=4, seed=7, start_ms=start)))
    later = np.asarray([t >= start + DAY_MS for t in times])
    by_hand = evaluate(model, X[later], y[later], [r for r, m in zip(rows, later, strict=True) if m])
    assert one["model"] == by_hand["model"] and one["rules"] == by_hand["rules"]
    assert one["period"]["start_ms"] == start + DAY_MS
    pooled = res["pooled"]
    assert pooled["test_events"] == one["test_events"] + other["test_events"]
    assert pooled["test_fraud"] == one["test_fraud"] + other["test_fraud"] > 0
    ratios = [one["recall_ratio_model_vs_rules"], other["recall_ratio_model_vs_rules"]]
    assert [res["ratio_min"], res["ratio_max"]] == [min(ratios), max(ratios)]

    from pipeline.cli import main

    argv = ["risk", "evaluate", "--seeds", "7,3", "--customers", "400", "--days", "3", "--warm-days", "1"]
    assert main([*argv, "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "p.json")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "p.json").read_text())["pooled"] == pooled
    printed = json.loads(capsys.readouterr().out)
    assert [p["seed"] for p in printed["periods"]] == [7, 3]
    assert printed["pooled"]["fraud"] == pooled["test_fraud"]
    assert printed["pooled"]["ratio"] == pooled["recall_ratio_model_vs_rules"]
    assert main(["risk", "evaluate", "--seeds", "7,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    # a period too small to hold fraud says so instead of scoring nothing
    assert (
        main(["risk", "evaluate", "--seeds", "7", "--customers", "20", "--days", "0.5", "--warm-days", "0"])
        == 2
    )
    assert "fraudulent of" in capsys.readouterr().err


def test_packaged_model_beats_the_rules_on_its_own_report() -> None:
    model = RiskModel.load()
    rep = model.meta["report"]
    assert rep["model"]["recall"] >= 2 * rep["rules"]["recall"]
    assert set(rep["by_scenario"]) == {
        "amount_spike",
        "compromised_terminal",
        "account_takeover",
        "card_testing",
    }


@pytest.mark.heavy
def test_bench_risk_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    assert "risk" in SCENARIOS
    out = tmp_path / "risk.json"
    assert run_bench("risk", quick=True, json_path=out, broker=kafka) == 0
    assert out.with_suffix(".png").stat().st_size > 1000
    r = json.loads(out.read_text())
    assert r["scenario"] == "risk" and r["quick"] is True
    chk = r["check"]
    assert chk["missing"] == 0 and chk["mismatched_decisions"] == 0 and chk["repeats_differing"] == 0
    assert chk["late_wrong"] == 0 and chk["decisions_checked"] >= r["steady"]["events"] + r["burst"]["events"]
    for phase in ("steady", "burst", "capacity", "within_capacity", "crash"):
        lat = r[phase]["latency"]
        assert lat["count"] == r[phase]["events"] and 0 <= lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    assert r["capacity"]["events_per_s_per_worker"] > 0 and r["crash"]["restart_s"] > 0
    assert 0 < r["feature_cache_hit_share"] <= 1
    q = r["model_quality"]
    assert q["test_fraud"] > 0 and 0 <= q["rules"]["recall"] <= q["model"]["recall"] <= 1
    names = {t["name"] for t in r["targets"]}
    assert any("per worker" in n for n in names) and any("brute force" in n for n in names)


@pytest.mark.heavy
def test_risk_phases_reports_capacity_latency_and_full_collections(kafka: EmbeddedKafka) -> None:
    """``python -m pipeline.devtools.risk_phases`` (the A/B of two checkouts), small, on a stream
    simulated for more events than the phases send: each phase sends what it names and every event
    is decided, the numbers are in order, and the worker's generation-2 collections are counted (a
    worker makes several while it starts: the models, then the frozen heap)."""
    from pipeline.devtools.risk_phases import run_phases

    r = run_phases(pre=300, capacity=300, low=150, rate=100.0, broker=kafka, simulate=900)
    assert r["simulated"] == 900 and r["low_decided"] == 150  # the phases take only what they name
    assert r["capacity_events_per_s"] > 0
    assert 0 < r["low_p50_ms"] <= r["low_p90_ms"] <= r["low_p99_ms"]
    assert r["gc2_count_total"] >= 1 and r["gc2_seconds_total"] > 0
    assert 0 <= r["gc2_count_low"] <= r["gc2_count_total"]


def test_scores_inputs_at_the_split_thresholds_as_scikit_learn_does() -> None:
    """Inputs equal to a split's threshold once rounded to float32, and the float32 values either
    side of it, land on the side scikit-learn's own trees send them to (``raw`` compares float32
    inputs with thresholds rounded down to float32)."""
    from sklearn.ensemble import GradientBoostingClassifier

    from models.risk import _export

    rng = np.random.default_rng(3)
    Xr = (rng.normal(size=(600, len(INPUTS))) * 1000).astype(np.float32)
    yr = (Xr[:, 0] + Xr[:, 5] * 0.001 * Xr[:, 9] > 300).astype(int)
    gb = GradientBoostingClassifier(n_estimators=30, max_depth=3).fit(Xr, yr)
    model = _export(gb, {})
    rows = []
    for f, t in zip(model.feature.tolist(), model.threshold.tolist(), strict=True):
        if f < 0:
            continue
        t32 = np.float32(t)
        for v in (np.nextafter(t32, np.float32(-np.inf)), t32, np.nextafter(t32, np.float32(np.inf))):
            row = Xr[len(rows) % len(Xr)].copy()
            row[f] = v
            rows.append(row)
    X = np.asarray(rows, dtype=np.float32)
    assert len(X) > 100
    assert np.allclose(model.raw(X), gb.decision_function(X), rtol=0, atol=1e-9)


def test_vectorize_reads_features_by_name_whatever_their_order() -> None:
    """The features the feature code makes (every name, in order) are read in order; any other dict is
    read by name, a missing feature as -1."""
    eng = FeatureEngine()
    rows = [
        (e, f) for e in simulate(SimConfig(customers=30, days=1, seed=5))[:200] if (f := eng.process(e)[1])
    ]
    assert rows
    for e, f in rows[:50]:
        row = vectorize(e, f)
        assert vectorize(e, dict(reversed(f.items()))) == row
        some = {k: v for i, (k, v) in enumerate(f.items()) if i % 2}
        partial = vectorize(e, some)
        assert all(partial[i] == (row[i] if i % 2 else -1.0) for i in range(len(f)))
