"""The risk path's JSON (orjson): the same documents the standard library wrote, so states already
in a table or a changelog read back unchanged, and the run-to-run tool compares the two."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.devtools import risk_serialisation
from pipeline.risk import jsonio
from pipeline.risk.features import SPECS, EntityState, FeatureConfig, step

CFG = FeatureConfig(grace_ms=5_000, horizon_ms=86_460_000, small_amount_cents=500, dedup_ids=16, seen_max=64)


def _state() -> EntityState:
    st = EntityState(SPECS["account"], CFG)
    for i in range(40):
        ev = {
            "event_id": f"e{i}",
            "type": "payment",
            "account": "acct-1",
            "card": f"card-{i % 3}",
            "device": f"dev-{i % 2}",
            "ip": "10.0.0.1",
            "amount": 12.5 + i,
            "currency": "EUR",
            "merchant": f"m{i % 5}",
            "country": ("DE", "FR")[i % 2],
            "event_time_ms": 1_700_000_000_000 + 37_000 * i,
        }
        step(SPECS["account"], CFG, st, ev)
    return st


def test_a_state_is_the_same_bytes_the_standard_library_wrote_and_reads_back() -> None:
    st = _state()
    st.pos = (3, 1041, 7)
    st.wrote = 1_700_000_100_000
    doc = {"h": st.head, "t": [list(ts.items()) for ts in st.tiles], "s": st.seen, "r": list(st.recent)}
    assert st.dumps() == risk_serialisation._stdlib_dumps({"w": st.wrote, **doc, "p": [3, 1041, 7]})
    back = EntityState.loads(st.dumps(), SPECS["account"], CFG)
    assert (back.head, back.tiles, back.seen, list(back.recent), back.pos, back.wrote) == (
        st.head,
        st.tiles,
        st.seen,
        list(st.recent),
        (3, 1041, 7),
        1_700_000_100_000,
    )
    # a state written before orjson, positions and expiry (tables and changelogs hold such) reads back
    old = EntityState.loads(risk_serialisation._stdlib_dumps(doc), SPECS["account"], CFG)
    assert (old.head, old.tiles, old.seen, list(old.recent), old.pos, old.wrote) == (
        st.head,
        st.tiles,
        st.seen,
        list(st.recent),
        None,
        None,
    )


def test_sets_and_numpy_scalars_are_written_and_anything_else_refused() -> None:
    assert json.loads(jsonio.dumps({"d": {"x"}, "s": np.float64(0.25), "n": np.int64(3)})) == {
        "d": ["x"],
        "s": 0.25,
        "n": 3,
    }
    with pytest.raises(TypeError):
        jsonio.dumps({"x": object()})
    with pytest.raises(ValueError):
        jsonio.loads(b"{not json")


def test_the_serialisation_tool_runs_both_codecs_on_the_same_chain(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert risk_serialisation.main(["--events", "400", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "json: serialisation" in out and "orjson: serialisation" in out
    assert jsonio.dumps is not risk_serialisation._stdlib_dumps  # the tool put orjson back
