"""``surge risk ...``: simulate, train, publish rules, and the demo (docs/architecture.md, "Risk").

* ``surge risk simulate --out events.jsonl``: the transaction simulator (:mod:`pipeline.risk.simulate`);
* ``surge risk train --data events.jsonl --out DIR``: the model (:mod:`models.risk`), with its report;
* ``surge risk rules publish --defaults | --file rules.json`` / ``surge risk rules show``;
* ``surge risk demo``: an embedded broker, a risk worker, a simulated stream at a rate, decisions
  printed as they arrive, a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.risk.rules import Rule
    from pipeline.risk.simulate import SimConfig
    from pipeline.settings import Settings

#: what a risk worker prints once its rules are read (the demo, the benchmark and the tests wait for it)
RISK_READY = "surge risk ready"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("risk", help="real-time risk scoring: simulate, train, rules, demo")
    rs = r.add_subparsers(dest="risk_command", required=True)

    sim = rs.add_parser("simulate", help="write simulated transactions with labelled fraud (JSON lines)")
    sim.add_argument("--out", required=True)
    _sim_args(sim)
    sim.set_defaults(fn=cmd_simulate)

    tr = rs.add_parser("train", help="train the risk model on simulated events; prints its report")
    tr.add_argument("--data", default=None, help="file from `surge risk simulate` (default: simulate now)")
    tr.add_argument("--out", required=True, help="model folder (risk_model.npz, risk_model.json)")
    tr.add_argument("--estimators", type=int, default=150)
    tr.add_argument("--depth", type=int, default=3)
    tr.add_argument("--train-share", type=float, default=0.7, help="earlier share of the period to fit on")
    _sim_args(tr)
    tr.set_defaults(fn=cmd_train)

    ev = rs.add_parser(
        "evaluate",
        help="recall at 1 %% false positives of a model and of the rules on later simulated periods",
    )
    ev.add_argument("--model", default=None, help="model folder (default: the packaged model)")
    ev.add_argument(
        "--seeds",
        default="7",
        help="comma-separated simulation seeds, one period each (the training seed: its own world, later)",
    )
    ev.add_argument("--customers", type=int, default=2000)
    ev.add_argument("--days", type=float, default=7.0, help="days scored per period")
    ev.add_argument("--warm-days", type=float, default=3.0, help="days before them that only fill windows")
    ev.add_argument("--json", default=None, help="write the whole report here")
    ev.add_argument(
        "--plot", default=None, help="PNG: recall of the model and the rules per period and pooled"
    )
    ev.set_defaults(fn=cmd_evaluate)

    ru = rs.add_parser("rules", help="publish or show the rules on surge.risk.rules")
    ru.add_argument("action", choices=["publish", "show"])
    ru.add_argument("--defaults", action="store_true", help="publish the default rules")
    ru.add_argument("--file", default=None, help="JSON list of rules to publish")
    ru.set_defaults(fn=cmd_rules)

    d = rs.add_parser("demo", help="embedded Kafka + a risk worker + a simulated event stream")
    d.add_argument("--n", type=int, default=3000, help="events to send")
    d.add_argument("--rate", type=float, default=300.0, help="events per second")
    d.add_argument("--data-dir", default=".surge-risk-demo", help="where the demo keeps broker and tables")
    d.add_argument("--summary-json", default=None)
    d.add_argument("--quiet", action="store_true", help="only the progress line and the summary")
    d.add_argument("--all", action="store_true", help="print approvals too (default: review/decline only)")
    d.add_argument(
        "--escalate-url",
        default=None,
        help="also run a request-path worker on this OpenAI-compatible endpoint (a DeepSeek or vLLM "
        "server, .../v1) and escalate borderline decisions to it (docs/architecture.md, 'Risk: escalation')",
    )
    d.add_argument("--escalate-model", default="default", help="the model name the endpoint serves")
    d.add_argument(
        "--escalate-budget-ms",
        type=int,
        default=None,
        help="the escalation request's deadline after the event (default: SURGE_RISK_ESCALATION_BUDGET_MS); "
        "the decision waits 50 ms more at most",
    )
    d.set_defaults(fn=cmd_demo)


def _sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--customers", type=int, default=2000)
    p.add_argument("--days", type=float, default=14.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--fraud-scale", type=float, default=1.0, help="multiplies every fraud scenario's rate")


def _sim_config(args: argparse.Namespace) -> SimConfig:
    from pipeline.risk.simulate import SimConfig

    return SimConfig(customers=args.customers, days=args.days, seed=args.seed, fraud_scale=args.fraud_scale)


def cmd_simulate(args: argparse.Namespace) -> int:
    from pipeline.risk.simulate import simulate, write_jsonl

    cfg = _sim_config(args)
    events = simulate(cfg)
    n = write_jsonl(args.out, events, cfg)
    by = Counter(e["scenario"] or "legitimate" for e in events)
    print(json.dumps({"events": n, "by_scenario": dict(by), "out": args.out}, indent=2))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from models.risk import train
    from pipeline.risk.simulate import read_jsonl, simulate

    if args.data:
        events, meta = read_jsonl(args.data)
    else:
        cfg = _sim_config(args)
        events, meta = simulate(cfg), dataclasses.asdict(cfg)
    model, report = train(
        events,
        train_share=args.train_share,
        n_estimators=args.estimators,
        max_depth=args.depth,
        sim_config=meta,
    )
    model.meta["command"] = (
        "surge " + " ".join(sys.argv[1:]) if sys.argv[0].endswith(("surge", "cli.py")) else None
    )
    out = model.save(args.out)
    print(json.dumps({"model_version": model.version, "out": str(out), **report}, indent=2))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from models.risk import RiskModel, RiskModelError, evaluate_later_periods

    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        print(f"--seeds: comma-separated integers, got {args.seeds!r}", file=sys.stderr)
        return 2
    if not seeds:
        print("--seeds: at least one seed", file=sys.stderr)
        return 2
    try:
        model = RiskModel.load(args.model)
        res = evaluate_later_periods(
            model, seeds, customers=args.customers, days=args.days, warm_days=args.warm_days
        )
    except RiskModelError as exc:
        print(f"surge risk evaluate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if args.plot:
        plot_periods(res, Path(args.plot))
    pooled = res["pooled"]
    print(
        json.dumps(
            {
                "model_version": res["model_version"],
                "periods": [
                    {
                        "seed": p["period"]["seed"],
                        "fraud": p["test_fraud"],
                        "model_recall": p["model"]["recall"],
                        "rules_recall": p["rules"]["recall"],
                        "ratio": p["recall_ratio_model_vs_rules"],
                    }
                    for p in res["periods"]
                ],
                "pooled": {
                    "events": pooled["test_events"],
                    "fraud": pooled["test_fraud"],
                    "model_recall": pooled["model"]["recall"],
                    "rules_recall": pooled["rules"]["recall"],
                    "ratio": pooled["recall_ratio_model_vs_rules"],
                },
                "ratio_range": [res["ratio_min"], res["ratio_max"]],
            },
            indent=2,
        )
    )
    return 0


def plot_periods(res: dict[str, Any], path: Path) -> None:
    """Bars of the model's and the rules' recall at 1 % false positives, per period and pooled, each
    period's ratio written above it."""
    from pipeline.devtools.bench.report import figure

    reports = [*res["periods"], res["pooled"]]
    names = [f"seed {p['period']['seed']}" for p in res["periods"]] + ["pooled"]
    xs = list(range(len(reports)))
    title = f"{res['model_version']}: recall at 1 % false positives on later simulated periods"
    with figure(path, title, dpi=110, figsize=(max(6.0, 0.8 * len(reports) + 2), 4.0)) as (_, ax):
        ax.bar([x - 0.2 for x in xs], [r["model"]["recall"] for r in reports], 0.4, label="model")
        ax.bar([x + 0.2 for x in xs], [r["rules"]["recall"] for r in reports], 0.4, label="rules alone")
        for x, r in zip(xs, reports, strict=True):
            ax.annotate(
                f"{r['recall_ratio_model_vs_rules']}x",
                (x, r["model"]["recall"]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(xs, names, rotation=20, fontsize=8)
        ax.set_ylim(0, 1.12)
        ax.set_ylabel("recall")
        ax.legend(loc="lower right", fontsize=8)


def read_rules_file(path: str | Path) -> list[Rule]:
    """The rules of a rules file (a JSON list of rules), every one validated; raises
    :class:`~pipeline.risk.rules.RulesFileError` (the CLI exits 2 with its message) for a file that
    cannot be read, is not a JSON list, or holds a bad rule."""
    from pipeline.risk.rules import RulesFileError, rules_from_json

    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise RulesFileError(str(path), f"cannot be read: {exc.strerror or exc}") from exc
    return rules_from_json(text, str(path))


def cmd_rules(args: argparse.Namespace) -> int:
    from pipeline.cli import _settings
    from pipeline.kafka_security import client_options
    from pipeline.risk.rules import DEFAULT_RULES, RuleBook
    from pipeline.topics import TopicNames

    rules: list[Rule] = []
    if args.action == "publish":
        # the whole file read and validated before settings or a broker: a bad file publishes nothing
        if args.defaults:
            rules = list(DEFAULT_RULES)
        elif args.file:
            rules = read_rules_file(args.file)
        else:
            print("surge risk rules publish: give --defaults or --file", file=sys.stderr)
            return 2

    s = _settings()
    topic = TopicNames(s.topic_prefix).risk_rules

    async def publish(rules: list[Rule]) -> None:
        from pipeline.risk_client import publish_rules

        # one transaction: a worker applies the whole set as one version
        await publish_rules(s.bootstrap_servers, topic, rules, options=client_options(s))

    async def show() -> RuleBook:
        from pipeline.risk_client import read_rule_records

        book = RuleBook()
        _, errors = book.apply_many(await read_rule_records(s.bootstrap_servers, topic, client_options(s)))
        for exc in errors:  # left out, as the workers leave them out
            print(f"surge risk rules show: {exc.message}", file=sys.stderr)
        return book

    if args.action == "publish":
        asyncio.run(publish(rules))
        print(f"published {len(rules)} rules to {topic}")
        return 0
    book = asyncio.run(show())
    print(
        json.dumps(
            {
                "version": book.current.version,
                "rules": [r.model_dump(mode="json") for r in book.current.rules],
            },
            indent=2,
        )
    )
    return 0


# ---- demo ---------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    escalate = (
        Escalate(args.escalate_url, args.escalate_model, args.escalate_budget_ms)
        if args.escalate_url
        else None
    )
    summary = run_risk_demo(
        n=args.n,
        rate_per_s=args.rate,
        data_dir=Path(args.data_dir),
        quiet=args.quiet,
        show_all=args.all,
        escalate=escalate,
    )
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["decided"] == summary["sent"] else 1


@dataclasses.dataclass(frozen=True)
class Escalate:
    """The demo's model path: an OpenAI-compatible endpoint a request-path worker serves from."""

    url: str
    model: str = "default"
    #: the escalation request's deadline after the event; None: the setting's
    budget_ms: int | None = None

    def env(self) -> dict[str, str]:
        """Settings for both workers: escalation on, with a key of this run's own."""
        import secrets

        env = {"SURGE_RISK_ESCALATION_ENABLED": "true", "SURGE_RISK_ESCALATION_KEY": secrets.token_hex(16)}
        if self.budget_ms is not None:
            env["SURGE_RISK_ESCALATION_BUDGET_MS"] = str(self.budget_ms)
            env["SURGE_RISK_ESCALATION_WAIT_MAX_MS"] = str(self.budget_ms + 50)
        return env


def demo_events(n: int, seed: int = 11) -> list[dict[str, Any]]:
    """``n`` simulated events (a busy period of 600 customers), 2 % of them out of order and a few late."""
    from pipeline.risk.simulate import SimConfig, disorder, simulate

    days = max(0.5, n / (600 * 3.0))
    events = simulate(SimConfig(customers=600, days=days, seed=seed, fraud_scale=4.0))
    while len(events) < n:
        days *= 1.5
        events = simulate(SimConfig(customers=600, days=days, seed=seed, fraud_scale=4.0))
    events = events[:n]
    return disorder(events, share=0.02, late_share=0.002, grace_ms=5_000, seed=seed)


async def _drive(
    settings: Settings, events: list[dict[str, Any]], rate: float, quiet: bool, show_all: bool
) -> dict[str, Any]:
    from pipeline.devtools.demo import DemoStream
    from pipeline.kafka_security import client_options
    from pipeline.risk.records import RiskDecision
    from pipeline.risk.simulate import as_event
    from pipeline.risk_client import RiskClient
    from pipeline.topics import TopicNames

    t = TopicNames(settings.topic_prefix)
    stream = DemoStream(events, "event_id", desc="decided", unit="ev")
    labels = {e["event_id"]: e for e in events}

    def show(d: RiskDecision, arrived: float) -> None:
        if not stream.arrived(d.event_id, arrived) or quiet or (d.decision == "approve" and not show_all):
            return
        e = labels[d.event_id]
        truth = f"FRAUD:{e['scenario']}" if e["label"] else "legit"
        by = "" if d.escalation is None else f" [{d.path}: {d.escalation.outcome}]"
        reasons = d.reasons[:2] if d.escalation is None else [*d.reasons[:1], d.reasons[-1]]
        stream.bar.write(
            f"{d.decision:>8} {e['type']:<8} {e['account']} {e['amount']:>9.2f} {e['country']} "
            f"[{truth}]{by} score {d.score if d.score is not None else '-'}  {'; '.join(reasons)}"
        )

    async with RiskClient(
        settings.bootstrap_servers,
        events_topic=t.risk_events,
        decisions_topic=t.risk_decisions,
        on_decision=show,
        client_options=client_options(settings),
    ) as client:

        async def send(event: dict[str, Any]) -> asyncio.Future[RiskDecision]:
            return await client.send(as_event(event))

        decisions, elapsed = await stream.send(rate, send, client.producer.flush)
    stream.bar.close()
    outcome = Counter(d.decision for d in decisions)
    fraud = [d for d in decisions if labels[d.event_id]["label"]]
    caught = sum(1 for d in fraud if d.decision in ("review", "decline"))
    legit_flagged = sum(1 for d in decisions if not labels[d.event_id]["label"] and d.decision != "approve")
    return {
        "sent": len(events),
        "decided": len(decisions),
        "by_decision": dict(outcome),
        "late": sum(1 for d in decisions if d.late),
        "fraud_events": len(fraud),
        "fraud_flagged": caught,
        "legit_flagged": legit_flagged,
        "rule_versions": sorted({d.rule_version for d in decisions if d.rule_version}),
        "model_versions": sorted({d.model_version for d in decisions if d.model_version}),
        "by_path": dict(Counter(d.path for d in decisions)),
        "escalations": dict(Counter(d.escalation.outcome for d in decisions if d.escalation is not None)),
        "latency_ms": stream.latency_ms(),
        "events_per_s": round(len(decisions) / elapsed, 1),
        "seconds": round(elapsed, 2),
    }


def run_risk_demo(
    n: int,
    rate_per_s: float,
    data_dir: Path,
    quiet: bool = False,
    show_all: bool = False,
    escalate: Escalate | None = None,
) -> dict[str, Any]:
    """Start Kafka and a risk worker, stream ``n`` simulated events at ``rate_per_s``, stop everything.
    ``escalate``: a request-path worker on that endpoint too, and borderline decisions escalated to it."""
    from pipeline.devtools.demo import demo_stack
    from pipeline.settings import Settings

    # a fresh broker and fresh tables each run: the simulated stream is the same every time, and a
    # second run's events would otherwise be duplicates (or late) for the tables of the first
    shutil.rmtree(data_dir, ignore_errors=True)
    env = {"SURGE_ROLE": "risk", "SURGE_APP_ID": "surge-risk-demo", **(escalate.env() if escalate else {})}
    with demo_stack(data_dir, env) as stack:
        settings = Settings()
        from agents.risk import ensure_risk_topics

        asyncio.run(ensure_risk_topics(settings))
        events = demo_events(n)
        if escalate is not None:
            stack.start_worker(
                f"a request-path worker on {escalate.url} (model {escalate.model})",
                "all",
                env={
                    "SURGE_MODEL": "remote",
                    "SURGE_REMOTE_BASE_URL": escalate.url,
                    "SURGE_REMOTE_MODEL": escalate.model,
                    "SURGE_DATA_DIR": str(data_dir / "tables-requests"),
                },
            )
        worker = stack.start_worker("a risk worker (rules, model, RocksDB tables)", "risk", RISK_READY)
        print(f"worker ready; sending {len(events)} simulated events at {rate_per_s:g}/s\n", flush=True)
        summary = asyncio.run(_drive(settings, events, rate_per_s, quiet, show_all))
        summary["worker_log"] = str(worker.log_path)
    print(
        f"\nsent {summary['sent']}, decided {summary['decided']} {summary['by_decision']}, late {summary['late']}\n"
        f"fraud events {summary['fraud_events']}, flagged {summary['fraud_flagged']}; "
        f"legitimate flagged {summary['legit_flagged']}\n"
        f"produce-to-decision p50 {summary['latency_ms']['p50']} ms, p99 {summary['latency_ms']['p99']} ms, "
        f"{summary['events_per_s']} events/s; rules {summary['rule_versions']}, model {summary['model_versions']}"
        + (
            f"\ndecided by {summary['by_path']}; escalations {summary['escalations']}"
            if escalate is not None
            else ""
        )
    )
    return summary
