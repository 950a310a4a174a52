"""``surge replay`` and ``surge shadow`` (docs/architecture.md, "Replay")."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "replay",
        help="replay recorded topic history through another model or settings, and compare with live",
        description="Copies the records of --topic between --from and --to into an isolated pipeline "
        "(its own app id, topics, tables and state folder), collects its outputs and compares them with "
        "what live traffic got: report.json, report.png and a summary. With --shadow PERCENT it mirrors "
        "that share of live traffic to a candidate instead (as `surge shadow`).",
    )
    r.add_argument("--topic", choices=["requests", "risk-events"], default="requests")
    r.add_argument(
        "--from",
        dest="from_",
        default=None,
        help="start: epoch ms, ISO 8601 (UTC without a zone), or a time ago: now-2h (or --from=-2h)",
    )
    r.add_argument("--to", default="now", help="end (exclusive), same forms; default now")
    _common(r)
    r.add_argument(
        "--labels",
        default=None,
        help="risk-events: JSON lines with event_id and label "
        "(surge risk simulate) for recall at 1 %% false positives",
    )
    r.add_argument(
        "--no-warmup",
        action="store_true",
        help="risk-events: do not warm features from the 24 h before --from",
    )
    r.add_argument("--keep-topics", action="store_true", help="keep the replay's topics afterwards")
    r.add_argument(
        "--shadow",
        type=_percent,
        default=None,
        metavar="PERCENT",
        help="mirror PERCENT of live requests to the candidate instead of replaying a range",
    )
    r.add_argument("--duration-s", type=float, default=None, help="--shadow: stop after this long")
    r.set_defaults(fn=cmd_replay)

    sh = sub.add_parser(
        "shadow", help="mirror a share of live requests to a candidate model (shadow topic only)"
    )
    sh.add_argument(
        "--percent",
        type=_percent,
        required=True,
        help="share of live requests, by hash of request_id: above 0, at most 100",
    )
    _common(sh)
    sh.add_argument(
        "--duration-s", type=float, default=None, help="stop after this long (default: SIGINT/SIGTERM)"
    )
    sh.add_argument("--delete-topics", action="store_true", help="delete the shadow's topics at the end")
    sh.add_argument(
        "--window",
        type=_positive_int,
        default=10_000,
        help="the comparison covers the last N sampled requests (N >= 1)",
    )
    sh.set_defaults(fn=cmd_shadow)


def _percent(text: str) -> float:
    """A share of live traffic: a percentage above 0 and at most 100 (argparse names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"{text}: a percentage above 0 and at most 100")
    return value


def _positive_int(text: str) -> int:
    """A count of at least 1 (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        choices=["faq", "hf", "remote", "echo"],
        default=None,
        help="the candidate model (default: the live one, SURGE_MODEL)",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the candidate (field or SURGE_ name); repeatable",
    )
    p.add_argument(
        "--caches",
        choices=["exact", "off", "live"],
        default="exact",
        help="exact (default): exact repeats from the cache, empty at start; off: every request asks "
        "the model; live: caches and merging as live (answers of paraphrases then depend on timing)",
    )
    p.add_argument("--id", default=None, help="the replay's id (default: time and a random token)")
    p.add_argument("--out", default=None, help="folder of the report, plot, worker log and state")
    p.add_argument(
        "--rate", type=float, default=None, help="records/s copied at most (SURGE_REPLAY_RATE_PER_S)"
    )
    p.add_argument("--quiet", action="store_true")


def _sets(items: list[str]) -> dict[str, str]:
    from pipeline.replay.plan import parse_sets
    from pipeline.settings import Settings

    return parse_sets(items, list(Settings.model_fields))


def _candidate(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of :class:`pipeline.replay.runner.CandidateOptions`, from the flags ``surge replay``
    and ``surge shadow`` share."""
    return {
        "model": args.model,
        "sets": _sets(args.sets),
        "caches": args.caches,
        "out_dir": Path(args.out) if args.out else None,
        "rate_per_s": args.rate,
        "quiet": args.quiet,
    }


def cmd_replay(args: argparse.Namespace) -> int:
    if args.shadow is not None:
        args.percent, args.delete_topics, args.window = args.shadow, False, 10_000
        return cmd_shadow(args)
    from pipeline.records import now_ms
    from pipeline.replay import runner
    from pipeline.replay.plan import ReplayError, parse_time

    if args.from_ is None:
        raise ReplayError("--from is required (or --shadow PERCENT)")
    now = now_ms()
    opts = runner.ReplayOptions(
        topic=args.topic,
        from_ms=parse_time(args.from_, now),
        to_ms=parse_time(args.to, now),
        replay_id=args.id,
        keep_topics=args.keep_topics,
        labels_path=Path(args.labels) if args.labels else None,
        warmup=not args.no_warmup,
        **_candidate(args),
    )
    runner.run(opts)
    return 0


def cmd_shadow(args: argparse.Namespace) -> int:
    from pipeline.replay import shadow

    opts = shadow.ShadowOptions(
        percent=args.percent,
        shadow_id=args.id,
        duration_s=args.duration_s,
        delete_topics=args.delete_topics,
        window=args.window,
        **_candidate(args),
    )
    shadow.run(opts)
    return 0
