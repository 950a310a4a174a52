"""The layers of the code stay apart (docs/architecture.md, "Layout").

Read from the source (every ``import``, including ones inside functions), so a lazy import cannot hide a
dependency that a worker image or a unit test would then pull in:

* pure modules import neither Faust nor Kafka clients;
* the pipeline's core imports no model backend, no agent and no developer tool (``pipeline.devtools``);
  only the composition modules (the CLI, ``surge risk``, the replay runner) put the layers together;
* model backends import no agent, CLI or developer tool (their trainers are tools and may);
* agents import no developer tool.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: modules tested with a fake clock and a dict: no Faust, no Kafka client
PURE = (
    "pipeline/auth.py",
    "pipeline/batch_estimator.py",
    "pipeline/batcher.py",
    "pipeline/cache.py",
    "pipeline/dedup.py",
    "pipeline/degrade.py",
    "pipeline/guard.py",
    "pipeline/inference_config.py",
    "pipeline/isolation.py",
    "pipeline/keys.py",
    "pipeline/merge.py",
    "pipeline/offsets.py",
    "pipeline/pairs.py",
    "pipeline/ratelimit.py",
    "pipeline/records.py",
    "pipeline/replay/compare.py",
    "pipeline/replay/plan.py",
    "pipeline/replan.py",
    "pipeline/replybook.py",
    "pipeline/replyto.py",
    "pipeline/routing.py",
    "pipeline/scheduler.py",
    "pipeline/stats.py",
    "pipeline/terms.py",
    "pipeline/risk/features.py",
    "pipeline/risk/rules.py",
    "pipeline/risk/windows.py",
)
KAFKA_CLIENTS = ("faust", "aiokafka", "kafka", "mode")

#: where the layers are put together: these may import models, agents and developer tools
COMPOSITION = (
    "pipeline/cli.py",
    "pipeline/riskops.py",
    "pipeline/replay/cli.py",
    "pipeline/replay/runner.py",
    "pipeline/replay/shadow.py",
)


def imported(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (relative imports resolved from ``root``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.add(".".join([*base, node.module or ""]).rstrip("."))
            elif node.module:
                out.add(node.module)
    return out


def offending(path: Path, prefixes: tuple[str, ...], root: Path = ROOT) -> list[str]:
    mods = imported(path, root)
    return sorted(m for m in mods if any(m == p or m.startswith(p + ".") for p in prefixes))


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_kafka_client(module: str) -> None:
    path = ROOT / module
    assert path.is_file(), f"{module} is listed as pure but does not exist: update PURE"
    assert offending(path, KAFKA_CLIENTS) == []


def test_the_pipeline_core_imports_no_backend_agent_or_tool() -> None:
    core = [
        p
        for p in files("pipeline")
        if rel(p) not in COMPOSITION and not rel(p).startswith("pipeline/devtools/")
    ]
    bad = {rel(p): offending(p, ("models", "agents", "pipeline.devtools")) for p in core}
    assert {k: v for k, v in bad.items() if v} == {}


def test_model_backends_import_no_agent_cli_or_tool() -> None:
    backends = [p for p in files("models") if not p.name.endswith("_train.py")]
    bad = {
        rel(p): offending(p, ("agents", "pipeline.cli", "pipeline.riskops", "pipeline.devtools"))
        for p in backends
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_agents_import_no_developer_tool() -> None:
    bad = {rel(p): offending(p, ("pipeline.devtools", "pipeline.cli")) for p in files("agents")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    probe = tmp_path / "pipeline" / "probe.py"
    probe.parent.mkdir()
    probe.write_text("def f():\n    import faust\n    from .devtools import broker\n", encoding="utf-8")
    assert offending(probe, KAFKA_CLIENTS, tmp_path) == ["faust"]
    assert offending(probe, ("pipeline.devtools",), tmp_path) == ["pipeline.devtools"]
