"""Lint guard: private faust-streaming, aiokafka and mode APIs are used only in pipeline/compat.py.

A private attribute of those libraries can change in any release without notice; keeping every use
behind one small function in pipeline/compat.py (checked by tests/test_compat.py) means an upgrade
has one file to check. This test fails on, anywhere in pipeline/, agents/, models/ and tests/:

* ``from faust.streams import _current_event``: a private name imported from one of the libraries;
* ``consumer._client`` or ``getattr(producer, "_ensure_producer")``: an attribute whose name is one of
  the libraries' private names (those they define as ``self._x``, ``def _x`` or a module-level
  ``_x``), read from anything but ``self``/``cls`` (a class's own attributes are its business).

It cannot know an object's type, so a surge object whose private attribute happens to share such a
name is flagged too: use that attribute from its own class only, or make it public.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import aiokafka
import faust
import mode

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("pipeline", "agents", "models", "tests")
LIBRARIES = {"faust": faust, "aiokafka": aiokafka, "mode": mode}

#: where private APIs of the libraries are used on purpose
COMPAT = {"pipeline/compat.py", "tests/test_compat.py"}

#: files that still use private APIs directly, until they switch to pipeline.compat; empty it then.
#: Each entry names what to switch to.
NOT_YET_SWITCHED: dict[str, str] = {}

#: (file, expression) pairs that read a surge object's own private attribute whose name happens to be
#: a private name of the libraries too, with the object's class
SURGE_OBJECTS: dict[tuple[str, str], str] = {
    ("tests/test_security.py", "gw._in_flight"): "pipeline.gateway.Gateway",
    ("tests/test_shadow.py", "sh._sample"): "pipeline.replay.shadow.Shadow",
}

_DEFINED = re.compile(r"(?:\bself\.|\bcls\.|^\s*def |^\s*async def |^class |^)(_[A-Za-z]\w*)\b", re.MULTILINE)


@cache
def library_private_names() -> frozenset[str]:
    """Every private (one leading underscore) name the installed libraries define."""
    names: set[str] = set()
    for module in LIBRARIES.values():
        for path in Path(module.__file__).parent.rglob("*.py"):  # type: ignore[arg-type]
            names.update(_DEFINED.findall(path.read_text(encoding="utf-8", errors="replace")))
    return frozenset(n for n in names if not n.startswith("__"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(path: Path, source: str) -> list[str]:
    """``file:line: what`` for each use of a private library API in ``source``."""
    private = library_private_names()
    rel = path.relative_to(ROOT).as_posix()
    out: list[str] = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            parts = node.module.split(".")
            bad = [a.name for a in node.names if _is_private(a.name)] + [p for p in parts if _is_private(p)]
            if bad:
                out.append(f"{rel}:{node.lineno}: imports {', '.join(bad)} from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr in private:
            base = node.value
            if isinstance(base, ast.Name) and base.id in {"self", "cls"}:
                continue
            if (rel, ast.unparse(node)) in SURGE_OBJECTS:
                continue
            out.append(f"{rel}:{node.lineno}: .{node.attr} ({ast.unparse(node)})")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "setattr", "hasattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            out.append(f"{rel}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return out


def test_private_library_apis_are_used_only_in_compat() -> None:
    found: list[str] = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in COMPAT or rel in NOT_YET_SWITCHED:
                continue
            found += violations(path, path.read_text(encoding="utf-8"))
    assert not found, "use pipeline/compat.py (add a helper there) instead of:\n" + "\n".join(found)


def test_the_allow_list_is_still_needed() -> None:
    """An entry of NOT_YET_SWITCHED whose file no longer uses a private API must go."""
    stale = [
        rel
        for rel in NOT_YET_SWITCHED
        if (ROOT / rel).is_file() and not violations(ROOT / rel, (ROOT / rel).read_text(encoding="utf-8"))
    ]
    assert not stale, f"switched to pipeline.compat; remove from NOT_YET_SWITCHED: {stale}"


def test_the_guard_catches_each_kind_of_use() -> None:
    src = (
        "from faust.streams import _current_event\n"
        "async def f(consumer, producer, self):\n"
        "    await consumer._client.force_metadata_update()\n"
        "    getattr(producer, '_ensure_producer')()\n"
        "    self._client = None\n"
        "    return producer.send\n"
    )
    found = violations(ROOT / "pipeline" / "example.py", src)
    assert sorted(int(f.split(":")[1]) for f in found) == [1, 3, 4], found
    assert {"_client", "_ensure_producer", "_current_event"} <= library_private_names()
