"""The ``surge`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.devtools.bench import SCENARIOS
from pipeline.exceptions import SurgeError
from pipeline.terms import PRIORITIES, TIERS, Priority, Tier

if TYPE_CHECKING:
    from pipeline.auth import ApiKey


def _settings(**overrides: object):
    from pipeline.settings import Settings

    return Settings.load(**{k: v for k, v in overrides.items() if v is not None})


# ---- kafka --------------------------------------------------------------------------------------
def cmd_kafka(args: argparse.Namespace) -> int:
    from pipeline.devtools.broker import EmbeddedKafka, read_state, stop_pid

    data_dir = Path(args.data_dir)
    if args.action == "start":
        state = read_state(data_dir)
        if state is not None:
            print(f"already running: pid {state.pid}, bootstrap {state.bootstrap}")
            return 0
        s = _settings()
        k = EmbeddedKafka(
            data_dir,
            cache_dir=s.kafka_cache_dir,
            version=s.kafka_version,
            port=args.port,
            heap_mb=s.kafka_heap_mb,
            partitions=s.partitions,
        )
        state = k.start()
        print(f"Kafka {s.kafka_version} running: pid {state.pid}, bootstrap {state.bootstrap}")
        print(f"export SURGE_BROKER=kafka://{state.bootstrap}")
        return 0
    state = read_state(data_dir)
    if args.action == "status":
        print(f"running: pid {state.pid}, bootstrap {state.bootstrap}" if state else "not running")
        return 0 if state else 1
    if state is None:
        print("not running")
        return 0
    stop_pid(state.pid)
    (data_dir / "surge-broker.json").unlink(missing_ok=True)
    print(f"stopped pid {state.pid}")
    return 0


# ---- worker -------------------------------------------------------------------------------------
def cmd_worker(args: argparse.Namespace) -> int:
    from agents.worker import build_worker_app, install_event_loop
    from pipeline.admin import ensure_topics

    s = _settings(role=args.role, web_port=args.web_port)
    if s.model == "hf" and s.role != "risk":
        from models.registry import build_model

        # a folder that holds no model: ModelLoadError (exit 2) before any topic is created
        build_model(s).peek_version()
    install_event_loop(s)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(ensure_topics(s))
    from pipeline.admin import cluster_id
    from pipeline.statedir import claim

    moved = claim(s.data_dir, asyncio.run(cluster_id(s)))
    if moved is not None:  # stores of another cluster: Faust would refuse them (ConsistencyError)
        logging.getLogger("surge.worker").warning(
            "%s held table stores of another Kafka cluster; moved to %s, tables restored from this "
            "cluster's changelogs",
            s.data_dir,
            moved,
        )
    if s.role == "risk":
        from agents.risk import ensure_risk_topics

        asyncio.run(ensure_risk_topics(s))
    app, rt = build_worker_app(s)

    if rt.inference is not None:
        # models loaded and warm before the worker joins the group: it never holds partitions it
        # cannot serve yet
        rt.inference.load()

    from agents.lifecycle import SurgeWorker, freeze_startup_heap

    freeze_startup_heap()
    from pipeline.metrics import gc_pause_timer

    gc_pause_timer(rt.metrics).install()  # surge_gc_pause_seconds: how long collections stop the worker
    worker = SurgeWorker(app, rt.lifecycle, loglevel="WARNING", quiet=True, redirect_stdouts=False)
    # Faust's start-up spinner sets the root logger to DEBUG for good: every debug call of aiokafka and
    # Faust would then build a log record (a tenth of a busy worker's time); no spinner, no DEBUG.
    worker.spinner = None
    worker.execute_from_commandline()
    return 0


# ---- send / tail --------------------------------------------------------------------------------
def _positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


#: the environment variable ``surge send --api-key`` defaults to
SEND_API_KEY_ENV = "SURGE_SEND_API_KEY"


def send_signer(presented: str | None) -> ApiKey | None:
    """The key ``surge send`` signs with: ``--api-key``, else :data:`SEND_API_KEY_ENV`, else none;
    :class:`~pipeline.exceptions.InvalidRequestError` when it cannot be a key."""
    import os

    from pipeline.auth import KEY_RE, ApiKey
    from pipeline.exceptions import InvalidRequestError

    key = presented if presented is not None else os.environ.get(SEND_API_KEY_ENV)
    if not key:
        return None
    if not KEY_RE.fullmatch(key):
        raise InvalidRequestError("--api-key must be 1-256 printable ASCII characters without spaces")
    return ApiKey(key=key)


def cmd_send(args: argparse.Namespace) -> int:
    import uuid

    from pipeline.client import SurgeClient
    from pipeline.kafka_security import client_options
    from pipeline.records import decode_request
    from pipeline.topics import TopicNames

    s = _settings()
    t = TopicNames(s.topic_prefix)
    signer = send_signer(args.api_key)
    # tenant, tier and priority only when given: left out, a signed record gets its key's, an
    # unsigned one the record's defaults (default, standard, interactive)
    chosen = {"tenant": args.tenant, "tier": args.tier, "priority": args.priority}
    req = {
        "request_id": args.request_id or uuid.uuid4().hex,
        "user_id": args.user,
        **{k: v for k, v in chosen.items() if v is not None},
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
    }
    # checked as a worker checks it (InvalidRequestError, exit 2), so a request a worker would only
    # dead-letter (an empty user id: no reply to wait for) is refused here, not waited on
    raw = json.dumps(req, ensure_ascii=False).encode("utf-8", "surrogatepass")
    decode_request(raw, None, max_record_bytes=s.max_record_bytes, max_content_bytes=s.max_content_bytes)

    async def main() -> int:
        async with SurgeClient(
            s.bootstrap_servers,
            requests_topic=t.requests,
            reply_topic=t.replies,
            security=client_options(s),
            signer=signer,
        ) as c:
            reply = await c.request(req, timeout_s=args.timeout_s)
        print(reply.model_dump_json(exclude_none=True, indent=2))
        return 0 if reply.status == "ok" else 2

    try:
        return asyncio.run(main())
    except TimeoutError:
        print(
            f"surge send: no reply to request {req['request_id']} within {args.timeout_s:g} s; it was "
            "sent and may still be answered (surge tail shows replies as they come; with --api-key, "
            "only a reply signed back with that key is taken)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(f"surge send: interrupted; request {req['request_id']} may have been sent", file=sys.stderr)
        return 130


def cmd_tail(args: argparse.Namespace) -> int:
    from pipeline.client import SurgeClient
    from pipeline.kafka_security import client_options
    from pipeline.topics import TopicNames

    s = _settings()
    topic = args.topic or TopicNames(s.topic_prefix).replies

    async def main() -> None:
        def show(r: object) -> None:
            print(r.model_dump_json(exclude_none=True), flush=True)  # type: ignore[attr-defined]

        async with SurgeClient(
            s.bootstrap_servers,
            reply_topic=topic,
            on_reply=show,
            from_beginning=args.from_beginning,
            security=client_options(s),
        ):
            await asyncio.Event().wait()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0


# ---- demo ---------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.devtools.demo import run_demo

    try:
        summary = run_demo(n=args.n, rate_per_s=args.rate, data_dir=Path(args.data_dir), quiet=args.quiet)
    except KeyboardInterrupt:  # the demo's broker and worker are stopped on the way out
        print("surge demo: interrupted", file=sys.stderr)
        return 130
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["answered"] == summary["sent"] else 1


# ---- faq / dedup --------------------------------------------------------------------------------
def cmd_faq(args: argparse.Namespace) -> int:
    from models import faq_train

    if args.action == "train":
        if args.out_dir is None:  # the shipped weights are replaced only when their folder is named
            print(
                "surge faq train: --out-dir is required: the weights go there, and a worker reads them "
                "with SURGE_FAQ_DATA_DIR",
                file=sys.stderr,
            )
            return 2
        report = faq_train.train(args.data, args.out_dir)
    else:
        from models.faq import FAQAnswerer

        report = faq_train.evaluate(args.data, FAQAnswerer(args.model_dir or _settings().faq_data_dir))
    print(json.dumps(report, indent=2, default=str))
    return 0


def cmd_dedup(args: argparse.Namespace) -> int:
    if args.action == "train":
        return _dedup_train(args)
    from pipeline.devtools.dedup_eval import parse_thresholds, run_dedup_eval
    from pipeline.pairs import decision_from_settings

    s = _settings()
    thresholds = parse_thresholds(args.thresholds) if args.thresholds else [s.semantic_threshold]
    run_dedup_eval(
        args.pairs,
        thresholds,
        json_out=args.json,
        embedder_path=s.embedder_path,
        decision=decision_from_settings(s),
    )
    return 0


def _dedup_train(args: argparse.Namespace) -> int:
    from models import merge_train

    if args.out_dir is None:  # the shipped weights are replaced only when their folder is named
        print(
            "surge dedup train: --out-dir is required: the weights go there, and a worker reads them "
            "with SURGE_MERGE_DATA_DIR (the shipped ones are in pipeline/merge_data)",
            file=sys.stderr,
        )
        return 2
    report = merge_train.train(args.data, args.out_dir, plot_path=args.plot, report_path=args.json)
    print(json.dumps(report["heads"], indent=2))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pipeline.devtools.bench import run_bench

    options = {"banking77_csv": args.data} if args.data else {}
    return run_bench(
        args.scenario,
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        limit_qps=args.limit_qps,
        **options,
    )


def cmd_gateway(args: argparse.Namespace) -> int:
    from pipeline.gateway import run_gateway

    return run_gateway(_settings(gateway_port=args.port))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="surge", description="Kafka-native inference pipeline for traffic surges"
    )
    sub = p.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kafka", help="the embedded Apache Kafka broker")
    k.add_argument("action", choices=["start", "stop", "status"])
    k.add_argument("--data-dir", default=".surge-kafka", help="broker data dir (kept across restarts)")
    k.add_argument("--port", type=int, default=None, help="listener port (default: a free one)")
    k.set_defaults(fn=cmd_kafka)

    w = sub.add_parser("worker", help="run a Faust worker (SURGE_* settings)")
    w.add_argument("--role", choices=["intake", "inference", "all", "risk"], default=None)
    w.add_argument("--web-port", type=int, default=None)
    w.set_defaults(fn=cmd_worker)

    s = sub.add_parser("send", help="send one request and print its reply")
    s.add_argument("prompt")
    s.add_argument("--user", default="cli-user")
    s.add_argument(
        "--tenant", default=None, help="default: the API key's when signed, else 'default' (the record's)"
    )
    s.add_argument(
        "--tier",
        default=None,
        choices=TIERS,
        help=f"default: the API key's when signed, else {Tier.STANDARD.value} (the record's)",
    )
    s.add_argument(
        "--priority",
        default=None,
        choices=PRIORITIES,
        help=f"default: the API key's highest when signed, else {Priority.INTERACTIVE.value} (the record's)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help=f"sign the record with this API key (default: ${SEND_API_KEY_ENV}, else unsigned); a "
        "deployment with SURGE_API_KEYS serves only signed records (SURGE_KAFKA_REQUEST_AUTH)",
    )
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--request-id", default=None)
    s.add_argument("--timeout-s", type=_positive_seconds, default=30.0, help="how long to wait for the reply")
    s.set_defaults(fn=cmd_send)

    t = sub.add_parser("tail", help="print replies as they arrive")
    t.add_argument("--topic", default=None)
    t.add_argument("--from-beginning", action="store_true")
    t.set_defaults(fn=cmd_tail)

    d = sub.add_parser("demo", help="embedded Kafka + a worker + a stream of sample questions")
    d.add_argument("--n", type=int, default=200, help="questions to send")
    d.add_argument("--rate", type=float, default=20.0, help="questions per second")
    d.add_argument("--data-dir", default=".surge-demo", help="where the demo keeps broker and tables")
    d.add_argument("--summary-json", default=None, help="write the summary here")
    d.add_argument("--quiet", action="store_true", help="only the progress line and summary")
    d.set_defaults(fn=cmd_demo)

    f = sub.add_parser("faq", help="train or evaluate the FAQ answerer")
    f.add_argument("action", choices=["train", "eval"])
    f.add_argument("--data", required=True, help="CSV with text,category")
    f.add_argument("--out-dir", default=None, help="train: the folder to write the weights into (required)")
    f.add_argument(
        "--model-dir",
        default=None,
        help="eval: the weights to evaluate (default: SURGE_FAQ_DATA_DIR, else shipped)",
    )
    f.set_defaults(fn=cmd_faq)

    dd = sub.add_parser("dedup", help="evaluate semantic dedup on sentence pairs, or train its decision")
    dsub = dd.add_subparsers(dest="action", required=True)
    de = dsub.add_parser("eval", help="the merge decision beside plain cosine thresholds, per language")
    de.add_argument("--pairs", required=True, help="CSV sentence1,sentence2,score (0-5)")
    de.add_argument(
        "--thresholds", default=None, help="0.8,0.9 or start:stop:step; default: the configured threshold"
    )
    de.add_argument("--json", default=None, help="write the result here (and a PNG plot beside it)")
    de.set_defaults(fn=cmd_dedup)
    dt = dsub.add_parser("train", help="train the learned merge decision (STS-B en/zh, banking77)")
    dt.add_argument("--data", required=True, help="folder with stsb/ and banking77/ (their CSV files)")
    dt.add_argument(
        "--out-dir",
        default=None,
        help="the folder to write the weights into (required; SURGE_MERGE_DATA_DIR)",
    )
    dt.add_argument("--json", default=None, help="write the training report here")
    dt.add_argument("--plot", default=None, help="write the trade-off and calibration plot here")
    dt.set_defaults(fn=cmd_dedup)

    b = sub.add_parser("bench", help="benchmarks against baselines, on the embedded broker")
    b.add_argument(
        "scenario",
        choices=SCENARIOS,
    )
    b.add_argument("--quick", action="store_true", help="a small run (what the tests use)")
    b.add_argument("--json", default=None)
    b.add_argument("--plot", default=None, help="PNG path (default beside --json or bench-<scenario>.png)")
    b.add_argument(
        "--data", default=None, help="merging, surge, failover: the banking77 train.csv (text,category)"
    )
    b.add_argument(
        "--limit-qps",
        type=float,
        default=None,
        help="surge, failover: use this model-alone limit L (questions/s) instead of measuring it, so "
        "that runs compared side by side offer the same load",
    )
    b.set_defaults(fn=cmd_bench)

    g = sub.add_parser("gateway", help="OpenAI-compatible HTTP gateway")
    g.add_argument("--port", type=int, default=None)
    g.set_defaults(fn=cmd_gateway)

    from pipeline.riskops import add_parser as add_risk_parser

    add_risk_parser(sub)
    from pipeline.replay.cli import add_parser as add_replay_parser

    add_replay_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except SurgeError as exc:
        print(f"surge: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
