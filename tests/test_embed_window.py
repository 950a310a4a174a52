"""The embedding stage's batch window (pipeline/embed_window.py): pure logic, no Kafka."""

from __future__ import annotations

import pytest

from pipeline.embed_window import ArrivalRate, EmbedWindow


def steady(window: EmbedWindow, per_s: float, seconds: float = 5.0) -> float:
    """Arrivals at a steady ``per_s`` for ``seconds``; returns the time of the last one (ms)."""
    gap = 1000.0 / per_s
    t = 0.0
    for _ in range(int(seconds * per_s)):
        t += gap
        window.arrived(t)
    return t


@pytest.mark.parametrize("per_s", [5.0, 20.0, 65.0, 300.0])
def test_the_rate_follows_a_steady_stream(per_s: float) -> None:
    rate = ArrivalRate(tau_ms=1000.0)
    gap = 1000.0 / per_s
    t = 0.0
    for _ in range(int(10 * per_s)):
        t += gap
        rate.add(t)
    # right after an arrival the decayed count is at its top: the rate plus about one arrival
    assert per_s <= rate.per_s(t) <= per_s * 1.1 + 1.0
    assert rate.per_s(t + gap) == pytest.approx(rate.per_s(t) * 2.718281828 ** (-gap / 1000.0))


def test_the_rate_counts_a_burst_whole_and_forgets_it() -> None:
    rate = ArrivalRate(tau_ms=1000.0)
    rate.add(0.0, n=50)  # one fetch hands 50 records at once
    assert rate.per_s(0.0) == pytest.approx(50.0)
    assert rate.per_s(5000.0) < 0.5


def test_a_window_opens_only_while_company_is_expected_within_it() -> None:
    window = EmbedWindow(max_wait_ms=20.0)
    # 20/s: one arrival every 50 ms, longer than the window: the lone question waits for no one
    t = steady(window, 20.0)
    assert not window.open(t)
    assert window.left_ms(t, waiting=1, limit=64, realtime_waiting=False) == 0.0
    # 65/s: one every 15 ms: the window holds for 20 ms from the first item's arrival
    window = EmbedWindow(max_wait_ms=20.0)
    t = steady(window, 65.0)
    assert window.open(t)
    assert window.left_ms(t, waiting=1, limit=64, realtime_waiting=False) == pytest.approx(20.0)
    assert window.left_ms(t + 15.0, waiting=2, limit=64, realtime_waiting=False) == pytest.approx(5.0)
    assert window.left_ms(t + 21.0, waiting=2, limit=64, realtime_waiting=False) == 0.0


def test_a_realtime_arrival_or_a_full_batch_closes_the_window_at_once() -> None:
    window = EmbedWindow(max_wait_ms=50.0)
    t = steady(window, 200.0)
    assert window.open(t)
    assert window.left_ms(t + 1.0, waiting=3, limit=64, realtime_waiting=True) == 0.0
    # closed for good: nothing reopens it until the stage is idle again
    assert window.left_ms(t + 2.0, waiting=3, limit=64, realtime_waiting=False) == 0.0
    assert window.open(t + 10.0)
    assert window.left_ms(t + 12.0, waiting=64, limit=64, realtime_waiting=False) == 0.0


def test_no_window_when_it_is_off_or_nothing_arrived_lately() -> None:
    off = EmbedWindow(max_wait_ms=0.0)
    t = steady(off, 1000.0)
    assert not off.open(t)
    quiet = EmbedWindow(max_wait_ms=20.0)
    t = steady(quiet, 300.0)
    # ten seconds of silence: the next arrival is alone, and embedded at once
    quiet.arrived(t + 10_000.0)
    assert not quiet.open(t + 10_000.0)
    assert quiet.left_ms(t + 10_000.0, waiting=1, limit=64, realtime_waiting=False) == 0.0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_wait_ms"):
        EmbedWindow(max_wait_ms=-1.0)
    with pytest.raises(ValueError, match="tau_ms"):
        ArrivalRate(tau_ms=0.0)
