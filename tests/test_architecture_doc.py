"""docs/architecture.md stays the repository's own description: what it lists matches the code, and
every pointer into it names a section it has; so does every pointer into the measurement log
(docs/results/log.md), where README.md's results come from."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from pipeline.metrics import create_metrics
from pipeline.topics import TopicNames
from tests.deploy_metrics import ARCHITECTURE, documented_metrics

ROOT = ARCHITECTURE.parents[1]
LOG = ROOT / "docs" / "results" / "log.md"
SCANNED = ("pipeline", "agents", "models", "tests", "deploy", "README.md", "docs")

#: files that still cite DESIGN.md (which only some readers have) until their owners update them
NOT_YET_UPDATED: dict[str, str] = {}

_POINTER = re.compile(r'docs/architecture\.md[,:]?\s*\(?\s*"([^"]+)"((?:\s*(?:,|and)\s*"[^"]+")*)')
_LOG_POINTER = re.compile(r'docs/results/log\.md,\s*"([^"]+)"')


def _headings(doc: Path = ARCHITECTURE) -> set[str]:
    text = doc.read_text(encoding="utf-8")
    return {m.group(1).strip() for m in re.finditer(r"^#{2,3} (.+)$", text, flags=re.MULTILINE)}


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            out.append(path)
        else:
            out += [p for p in sorted(path.rglob("*")) if p.suffix in {".py", ".md", ".yaml", ".yml"}]
    return out


def test_every_pointer_names_a_section() -> None:
    headings = _headings()
    missing: list[str] = []
    for path in _files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in _POINTER.finditer(text):
            names = [m.group(1), *re.findall(r'"([^"]+)"', m.group(2))]
            line = text.count("\n", 0, m.start()) + 1
            missing += [f"{path.relative_to(ROOT)}:{line}: {n!r}" for n in names if n not in headings]
    assert not missing, f"docs/architecture.md has no section named: {missing}; sections: {sorted(headings)}"


def test_every_pointer_into_the_measurement_log_names_a_section() -> None:
    # a log heading may end in when and how it was measured, "(2026-12-05, late)": a pointer may leave it out
    headings = {h for full in _headings(LOG) for h in (full, full.split(" (")[0])}
    found: list[str] = []
    missing: list[str] = []
    for path in _files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in _LOG_POINTER.finditer(text):
            name = " ".join(m.group(1).split())  # a pointer may wrap onto the next line
            line = text.count("\n", 0, m.start()) + 1
            found.append(name)
            if name not in headings:
                missing.append(f"{path.relative_to(ROOT)}:{line}: {name!r}")
    assert found, "no pointer into docs/results/log.md found: is the pattern still right?"
    assert not missing, f"docs/results/log.md has no section named: {missing}"


def test_no_code_cites_design_md() -> None:
    found = []
    for top in ("pipeline", "agents", "models", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in NOT_YET_UPDATED or path == Path(__file__):
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if re.search(r"\bDESIGN(\.md)?\b(?!_)", line):
                    found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "point at docs/architecture.md instead:\n" + "\n".join(found)


def test_the_allow_list_is_still_needed() -> None:
    stale = [
        rel
        for rel in NOT_YET_UPDATED
        if not (ROOT / rel).is_file() or "DESIGN" not in (ROOT / rel).read_text(encoding="utf-8")
    ]
    assert not stale, f"updated; remove from NOT_YET_UPDATED: {stale}"


def test_the_metrics_table_is_what_the_factory_creates() -> None:
    registry = CollectorRegistry()
    create_metrics(registry)
    exported = {f.name + ("_total" if f.type == "counter" else ""): f.type for f in registry.collect()}
    assert documented_metrics() == exported


def test_the_topics_table_names_every_topic_surge_uses() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Topics\n", 1)[1].split("\n## ", 1)[0]
    t = TopicNames()
    for name in [t.requests, t.replies, t.deadletter]:
        assert f"`{name}`" in section, name
    assert "`surge.work.realtime`, `.interactive`, `.batch`, `.offline`" in section
    for table in ("ratelimit", "answers", "replybook"):
        assert f"`<app_id>-{table}-changelog`" in section, table
