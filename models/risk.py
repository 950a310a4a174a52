"""The risk model: gradient-boosted trees (scikit-learn) over the window features, stored without
pickle (docs/architecture.md, "Risk: the model").

* :func:`vectorize`: the model's inputs, the features of every entity plus a few of the event's own
  (amount, type, card present, hour), rounded to float32 as scikit-learn's trees compare them;
  a missing value (the event has no such entity) is -1.
* :func:`train`: replays simulated events (``surge risk simulate``) through the same feature code the
  workers run, fits ``GradientBoostingClassifier`` on the earlier part of the period and measures
  recall at a 1 % false-positive rate on the later part, against the rules alone.
* :class:`RiskModel`: the fitted trees as flat arrays (``risk_model.npz``) plus ``risk_model.json``
  (inputs, base score, version, training report). Scores batches with numpy; explains one event by
  each input's contribution along its tree paths.

``surge risk train`` writes a model folder; ``SURGE_RISK_MODEL_PATH`` points a worker at it. The
package ships one trained on the default simulation (``models/risk_data``).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import npz_bytes, replace_files
from pipeline.exceptions import SurgeError
from pipeline.risk.features import ALL_FEATURES, OK, FeatureConfig, FeatureEngine
from pipeline.risk.rules import DEFAULT_RULES, RuleSet
from pipeline.stats import recall_at_fpr

DATA_DIR = Path(__file__).resolve().parent / "risk_data"
WEIGHTS_FILE = "risk_model.npz"
META_FILE = "risk_model.json"
EVENT_INPUTS = (
    "event_amount",
    "event_log_amount",
    "event_is_payment",
    "event_is_transfer",
    "event_is_login",
    "event_card_present",
    "event_hour",
)
INPUTS: tuple[str, ...] = (*ALL_FEATURES, *EVENT_INPUTS)
MISSING = -1.0


class RiskModelError(SurgeError):
    """A model folder that is missing, incomplete or made for other inputs."""


def vectorize(event: dict[str, Any], features: dict[str, Any]) -> list[float]:
    """The model's inputs for one event, in :data:`INPUTS` order (float32-rounded by the caller)."""
    # a dict of every feature in ALL_FEATURES order (what the feature code makes) is read in order:
    # one lookup per feature was a third of a risk worker's scoring
    values = features.values() if tuple(features) == ALL_FEATURES else map(features.get, ALL_FEATURES)
    row: list[float] = [MISSING if v is None else v for v in values]
    amount = float(event["amount"])
    kind = event["type"]
    row += [
        amount,
        math.log1p(amount),
        float(kind == "payment"),
        float(kind == "transfer"),
        float(kind == "login"),
        float(event.get("card") is not None and event.get("device") is None),
        float((event["event_time_ms"] // 3_600_000) % 24),
    ]
    return row


class RiskModel:
    """Boosted trees as flat arrays. ``score_many`` and ``explain`` implement
    :class:`pipeline.risk.decide.Scorer`."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        if tuple(meta.get("inputs", ())) != INPUTS:
            raise RiskModelError(
                f"the model was trained on {len(meta.get('inputs', ()))} inputs that differ from this "
                f"version's {len(INPUTS)}; train it again with `surge risk train`"
            )
        self.feature = arrays["feature"].astype(np.int64)
        self.threshold = arrays["threshold"].astype(np.float64)
        self.left = arrays["left"].astype(np.int64)
        self.right = arrays["right"].astype(np.int64)
        self.value = arrays["value"].astype(np.float64)
        self.roots = arrays["roots"].astype(np.int64)
        self.base = float(meta["base"])
        self.depth = int(meta["max_depth"])
        self.meta = meta
        self.version: str = meta["version"]
        self._safe_feature = np.where(self.feature < 0, 0, self.feature)
        # for raw(): a leaf leads to itself (so a walk needs no test for leaves) and its test always
        # holds; thresholds as the largest float32 at or below them, so comparing float32 inputs
        # with them decides as comparing those inputs with the float64 thresholds does
        leaf = self.left < 0
        own = np.arange(self.left.size)
        self._walk_left = np.where(leaf, own, self.left)
        self._walk_right = np.where(leaf, own, self.right)
        thr = np.where(leaf, np.inf, self.threshold)
        thr32 = thr.astype(np.float32)
        above = thr32.astype(np.float64) > thr
        thr32[above] = np.nextafter(thr32[above], np.float32(-np.inf))
        self._walk_threshold = thr32
        # plain lists for the one-event walk of explain()
        self._lists = (
            self.feature.tolist(),
            self.threshold.tolist(),
            self.left.tolist(),
            self.right.tolist(),
            self.value.tolist(),
        )

    # ---- scoring -----------------------------------------------------------------------------
    def raw(self, X: np.ndarray) -> np.ndarray:
        """Log-odds of rows of :func:`vectorize` output (any float dtype; compared as float32, as
        scikit-learn's trees compare them)."""
        X = np.ascontiguousarray(X, dtype=np.float32)
        n, width = X.shape
        nodes = np.broadcast_to(self.roots, (n, self.roots.size)).copy()
        flat, row_start = X.ravel(), (np.arange(n) * width)[:, None]
        for _ in range(self.depth):
            go_left = flat[row_start + self._safe_feature[nodes]] <= self._walk_threshold[nodes]
            nodes = np.where(go_left, self._walk_left[nodes], self._walk_right[nodes])
        return self.base + self.value[nodes].sum(axis=1)

    def proba(self, X: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-np.clip(self.raw(X), -60, 60)))

    def score_many(self, rows: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> list[float]:
        if not rows:
            return []
        X = np.array([vectorize(ev, f) for ev, f in rows], dtype=np.float64)
        return [round(float(p), 6) for p in self.proba(X)]

    def explain(
        self, event: dict[str, Any], features: dict[str, Any], top: int = 3
    ) -> list[tuple[str, float, float]]:
        """The ``top`` inputs that raised the log-odds most along the event's tree paths: ``(name, input
        value, contribution)``; the value is -1 where the event lacks the entity."""
        x = np.asarray(vectorize(event, features), dtype=np.float32).astype(np.float64).tolist()
        feat, thr, left, right, value = self._lists
        contrib = [0.0] * len(INPUTS)
        for node in self.roots.tolist():
            while left[node] >= 0:
                f = feat[node]
                child = left[node] if x[f] <= thr[node] else right[node]
                contrib[f] += value[child] - value[node]
                node = child
        ranked = sorted(range(len(INPUTS)), key=lambda i: -contrib[i])[:top]
        return [(INPUTS[i], x[i], round(contrib[i], 4)) for i in ranked]

    # ---- files -------------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write the trees and their metadata into ``out_dir``, each file replaced whole
        (:func:`pipeline.atomic.replace_files`, the metadata last): a failed save leaves the old ones."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        arrays = {
            "feature": self.feature.astype(np.int32),
            "threshold": self.threshold,
            "left": self.left.astype(np.int32),
            "right": self.right.astype(np.int32),
            "value": self.value,
            "roots": self.roots.astype(np.int32),
        }
        meta = (json.dumps(self.meta, indent=2) + "\n").encode("utf-8")
        replace_files([(out / WEIGHTS_FILE, npz_bytes(arrays, compressed=False)), (out / META_FILE, meta)])
        return out

    @classmethod
    def load(cls, model_dir: str | Path | None = None) -> RiskModel:
        """Load a folder written by :meth:`save` (default: the packaged model)."""
        d = Path(model_dir) if model_dir else DATA_DIR
        wp, mp = d / WEIGHTS_FILE, d / META_FILE
        if not wp.is_file() or not mp.is_file():
            raise RiskModelError(f"no risk model in {d}: expected {WEIGHTS_FILE} and {META_FILE}")
        with np.load(wp, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        return cls(arrays, json.loads(mp.read_text()))


def _export(gb: Any, meta: dict[str, Any]) -> RiskModel:
    """Flatten a fitted binary GradientBoostingClassifier into :class:`RiskModel` arrays."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("feature", "threshold", "left", "right", "value")}
    roots, offset = [], 0
    lr = float(gb.learning_rate)
    for est in gb.estimators_[:, 0]:
        t = est.tree_
        roots.append(offset)
        is_leaf = t.children_left < 0
        parts["feature"].append(np.where(is_leaf, -2, t.feature))
        parts["threshold"].append(t.threshold)
        parts["left"].append(np.where(is_leaf, -1, t.children_left + offset))
        parts["right"].append(np.where(is_leaf, -1, t.children_right + offset))
        parts["value"].append(t.value[:, 0, 0] * lr)
        offset += t.node_count
    arrays = {k: np.concatenate(v) for k, v in parts.items()}
    arrays["roots"] = np.asarray(roots)
    prior = float(gb.init_.class_prior_[1])
    meta = {
        **meta,
        "base": math.log(prior / (1 - prior)),
        "max_depth": int(gb.max_depth),
        "inputs": list(INPUTS),
    }
    digest = hashlib.sha256()
    for k in sorted(arrays):
        digest.update(np.ascontiguousarray(arrays[k]).tobytes())
    digest.update(json.dumps(meta["inputs"]).encode())
    meta["version"] = f"risk-gbt-{digest.hexdigest()[:10]}"
    return RiskModel(arrays, meta)


def replay(
    events: Sequence[dict[str, Any]], cfg: FeatureConfig | None = None
) -> tuple[np.ndarray, np.ndarray, list[int], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Features of simulated events in event order: ``(X, labels, times, rows)``; late events skipped.
    ``rows`` holds ``(event, features)`` for the rules."""
    eng = FeatureEngine(cfg)
    X: list[list[float]] = []
    y: list[int] = []
    times: list[int] = []
    rows: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for sim in events:
        status, feats = eng.process(sim)
        if status != OK or feats is None:
            continue
        X.append(vectorize(sim, feats))
        y.append(int(sim.get("label", 0)))
        times.append(sim["event_time_ms"])
        rows.append((sim, feats))
    return np.asarray(X, dtype=np.float32), np.asarray(y, dtype=np.int8), times, rows


def train(
    events: Sequence[dict[str, Any]],
    *,
    cfg: FeatureConfig | None = None,
    train_share: float = 0.7,
    n_estimators: int = 150,
    max_depth: int = 3,
    negative_rate: float = 0.3,
    seed: int = 0,
    sim_config: dict[str, Any] | None = None,
    progress: bool = True,
) -> tuple[RiskModel, dict[str, Any]]:
    """Fit on events before the split time (``train_share`` of the period), report on the rest.

    Negatives are subsampled (``negative_rate``, reweighted) to keep the fit to seconds. The report
    gives recall at 1 % false positives on the later period for the model and for the default rules
    alone (ranked by their points)."""
    from sklearn.ensemble import GradientBoostingClassifier

    t0 = time.monotonic()
    X, y, times, rows = replay(events, cfg)
    if progress:
        print(f"features of {len(y)} events in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    if not len(y) or y.sum() == 0:
        raise RiskModelError(
            f"need labelled fraud to train on; got {len(y)} events, {int(y.sum())} fraudulent"
        )
    lo, hi = min(times), max(times)
    split = lo + (hi - lo) * train_share
    tr = np.asarray(times) < split
    rng = np.random.default_rng(seed)
    keep = tr & ((y == 1) | (rng.random(len(y)) < negative_rate))
    weight = np.where(y[keep] == 1, 1.0, 1.0 / negative_rate)
    gb = GradientBoostingClassifier(
        n_estimators=n_estimators, max_depth=max_depth, learning_rate=0.1, subsample=0.8, random_state=seed
    )
    t1 = time.monotonic()
    gb.fit(X[keep], y[keep], sample_weight=weight)
    if progress:
        print(
            f"fitted {n_estimators} trees on {int(keep.sum())} rows in {time.monotonic() - t1:.1f} s",
            file=sys.stderr,
        )
    meta = {
        "kind": "GradientBoostingClassifier",
        "n_estimators": n_estimators,
        "trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "train_rows": int(keep.sum()),
        "split_time_ms": int(split),
        "sim_config": sim_config,
    }
    model = _export(gb, meta)
    report = evaluate(model, X[~tr], y[~tr], [r for r, t in zip(rows, tr, strict=True) if not t])
    # operating points: review at 1 % false positives, decline at 0.1 %, on the later period
    model.meta["review_threshold"] = report["model"]["threshold"]
    model.meta["decline_threshold"] = max(report["model"]["threshold"], report["model_decline"]["threshold"])
    model.meta["report"] = report
    return model, report


def evaluate(
    model: RiskModel, X: np.ndarray, y: np.ndarray, rows: Sequence[tuple[dict[str, Any], dict[str, Any]]]
) -> dict[str, Any]:
    """Recall at 1 % false positives of the model and of the default rules on the same events."""
    from sklearn.metrics import roc_auc_score

    scores = model.proba(X)
    rules = RuleSet(DEFAULT_RULES)
    points = [rules.points(f, ev) for ev, f in rows]
    m = recall_at_fpr(scores, y, 0.01)
    m_decline = recall_at_fpr(scores, y, 0.001)
    r = recall_at_fpr(points, y, 0.01)
    scenarios: dict[str, dict[str, float]] = {}
    for name in sorted({scenario for ev, _ in rows if (scenario := ev.get("scenario"))}):
        mask = np.array([ev.get("scenario") == name for ev, _ in rows])
        scenarios[name] = {
            "events": int(mask.sum()),
            "model_recall": round(float((scores[mask] >= m["threshold"]).mean()), 4),
            "rules_recall": (
                round(float((np.asarray(points)[mask] >= r["threshold"]).mean()), 4)
                if math.isfinite(r["threshold"])
                else 0.0
            ),
        }
    return {
        "test_events": len(y),
        "test_fraud": int(y.sum()),
        "model": {**{k: round(v, 6) for k, v in m.items()}, "auc": round(float(roc_auc_score(y, scores)), 4)},
        "model_decline": {k: round(v, 6) for k, v in m_decline.items()},
        "rules": {**{k: round(v, 6) for k, v in r.items()}, "auc": round(float(roc_auc_score(y, points)), 4)},
        "recall_ratio_model_vs_rules": round(m["recall"] / r["recall"], 3) if r["recall"] else None,
        "by_scenario": scenarios,
    }


def evaluate_later_periods(
    model: RiskModel,
    seeds: Sequence[int],
    *,
    customers: int = 2000,
    days: float = 7.0,
    warm_days: float = 3.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Recall at 1 % false positives on simulated periods after the model's training period.

    Each seed simulates a world for ``warm_days + days`` from the end of the training period (the
    training seed: the same customers, merchants and devices, later; any other: a world the model never
    saw); the first ``warm_days`` only fill the windows. Fraud comes in few episodes per period (a few
    hundred fraudulent events from a dozen or so cards, terminals and accounts), so one period's recall
    ratio swings with its mix of scenarios; ``pooled`` scores every period's events together, one
    operating point for all."""
    from pipeline.risk.simulate import DAY_MS, SimConfig, simulate

    trained = model.meta.get("sim_config") or {}
    start = int(trained.get("start_ms", SimConfig().start_ms) + trained.get("days", 14) * DAY_MS)
    cut = start + warm_days * DAY_MS
    periods: list[dict[str, Any]] = []
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    all_rows: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for i, seed in enumerate(seeds, 1):
        t0 = time.monotonic()
        cfg = SimConfig(customers=customers, days=warm_days + days, seed=seed, start_ms=start)
        X, y, times, rows = replay(simulate(cfg))
        later = np.asarray([t >= cut for t in times], dtype=bool)
        kept = [r for r, m in zip(rows, later, strict=True) if m]
        fraud = int(y[later].sum())
        if fraud == 0 or fraud == int(later.sum()):
            raise RiskModelError(
                f"period of seed {seed} has {fraud} fraudulent of {int(later.sum())} events: recall needs "
                f"both; simulate more than {customers} customers or {days:g} days"
            )
        report = evaluate(model, X[later], y[later], kept)
        report["period"] = {"start_ms": int(cut), "days": days, "customers": customers, "seed": seed}
        periods.append(report)
        xs.append(X[later])
        ys.append(y[later])
        all_rows.extend(kept)
        if progress:
            print(
                f"period {i}/{len(seeds)} (seed {seed}): {report['test_fraud']} fraudulent of "
                f"{report['test_events']} events, recall model {report['model']['recall']:.3f} rules "
                f"{report['rules']['recall']:.3f} = {report['recall_ratio_model_vs_rules']}x "
                f"({time.monotonic() - t0:.0f} s)",
                file=sys.stderr,
            )
    pooled = evaluate(model, np.concatenate(xs), np.concatenate(ys), all_rows) if periods else None
    ratios = [p["recall_ratio_model_vs_rules"] for p in periods if p["recall_ratio_model_vs_rules"]]
    return {
        "model_version": model.version,
        "periods": periods,
        "pooled": pooled,
        "ratio_min": min(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
    }
