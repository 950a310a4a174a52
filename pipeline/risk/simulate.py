"""A transaction simulator written for surge: customers, merchants, cards, devices and IPs, with
labelled fraud scenarios (docs/architecture.md, "Risk: the simulator").

Legitimate life: each customer has a home country, one or two cards, one or two devices, a home IP
(some share a carrier-grade NAT or a public Wi-Fi address), a spending habit (log-normal amounts), a
few favourite merchants, and a daily rhythm of logins, card-present and online payments and the odd
transfer. Noise that looks like fraud: trips abroad, a new phone, a rare big purchase, coffee-sized
payments.

Fraud scenarios (``scenario`` on each fraudulent event, ``label`` 1):

* ``amount_spike``: a stolen card used at shops for amounts far above the customer's habit;
* ``compromised_terminal``: a few merchant terminals skim cards for two days; the cloned cards are
  used abroad a few days later, in bursts;
* ``account_takeover``: a login from a new device and a foreign country (the fraudsters' devices and
  IPs serve several victims), then transfers that drain the account;
* ``card_testing``: bursts of small online payments on a stolen card from the fraudsters' IPs, often
  followed by a large one.

Deterministic: the same :class:`SimConfig` (seed included) gives the same events, byte for byte.
The customers, merchants and devices depend on the seed only; their events on the seed and the start,
so a later period of the same seed continues the same world with new days (a model trained on one
period is never scored on a time-shifted copy of it).
:func:`disorder` then makes a share of events arrive out of order (within the grace period) or late.

Pure: standard library only.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

HOME_COUNTRIES = ("DE", "FR", "NL", "ES", "IT", "GB", "PL", "SE", "BE", "AT")
HOME_WEIGHTS = (18, 15, 9, 12, 12, 14, 7, 5, 4, 4)
TRAVEL_COUNTRIES = ("US", "PT", "GR", "HR", "CH", "TH", "MX")
FRAUD_COUNTRIES = ("RO", "BG", "UA", "TR", "MA", "NG", "BR")
#: relative activity per hour of day (UTC), six hours a row
HOUR_WEIGHTS: tuple[float, ...] = (
    *(1, 0.6, 0.4, 0.3, 0.3, 0.5),
    *(1.2, 2.5, 3.5, 4, 4.2, 4.5),
    *(5, 4.8, 4.5, 4.5, 4.8, 5.2),
    *(5.5, 5, 4.2, 3.2, 2.2, 1.5),
)
DAY_MS = 86_400_000
HOUR_MS = 3_600_000
MINUTE_MS = 60_000
SCENARIOS = ("amount_spike", "compromised_terminal", "account_takeover", "card_testing")


@dataclass(frozen=True)
class SimConfig:
    """What to simulate. ``fraud_scale`` multiplies the rate of every fraud scenario."""

    customers: int = 2000
    days: float = 14.0
    start_ms: int = 1_735_689_600_000  # 2025-01-01T00:00:00Z
    seed: int = 7
    merchants_per_country: int = 40
    fraud_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.customers < 10:
            raise ValueError(f"customers={self.customers} must be at least 10")
        if self.days <= 0:
            raise ValueError(f"days={self.days} must be positive")


@dataclass
class _Customer:
    idx: int
    account: str
    home: str
    cards: list[str]
    devices: list[str]
    ip: str
    habit: float
    payments_per_day: float
    logins_per_day: float
    transfers_per_day: float
    favourites: list[str]
    coffee: bool


class _World:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        rng = random.Random(cfg.seed)
        countries = HOME_COUNTRIES + TRAVEL_COUNTRIES + FRAUD_COUNTRIES
        self.merchants: dict[str, list[str]] = {
            c: [f"m-{c}-{j:03d}" for j in range(cfg.merchants_per_country)] for c in countries
        }
        self.online = [f"m-web-{j:03d}" for j in range(cfg.merchants_per_country)]
        self.shared_ips = [f"ip-nat-{k:04d}" for k in range(max(2, cfg.customers // 40))]
        self.fraud_devices = [f"dev-x-{k:02d}" for k in range(12)]
        self.fraud_ips = [f"ip-x-{k:02d}" for k in range(16)]
        self.mules = [f"benef-x-{k:02d}" for k in range(20)]
        self.customers = [self._customer(i, random.Random(rng.random())) for i in range(cfg.customers)]

    def _customer(self, i: int, rng: random.Random) -> _Customer:
        home = rng.choices(HOME_COUNTRIES, HOME_WEIGHTS)[0]
        local = self.merchants[home]
        # a few popular shops per country: weights fall off with the index
        favourites = [local[min(len(local) - 1, int(rng.expovariate(1 / 6)))] for _ in range(6)]
        favourites += rng.sample(self.online, 2)
        activity = rng.gammavariate(2.0, 0.6)
        return _Customer(
            idx=i,
            account=f"acc-{i:06d}",
            home=home,
            cards=[f"card-{i:06d}-{k}" for k in range(1 + (rng.random() < 0.3))],
            devices=[f"dev-{i:06d}-{k}" for k in range(1 + (rng.random() < 0.4))],
            ip=rng.choice(self.shared_ips) if rng.random() < 0.15 else f"ip-{i:06d}",
            habit=math.exp(rng.gauss(3.3, 0.7)),
            payments_per_day=2.0 * activity,
            logins_per_day=1.5 * activity,
            transfers_per_day=0.15 * activity,
            favourites=favourites,
            coffee=rng.random() < 0.15,
        )


def _times(rng: random.Random, start_ms: int, days: float, per_day: float) -> list[int]:
    """Event times over the period with the daily rhythm (a Poisson count per day)."""
    out: list[int] = []
    whole = math.ceil(days)
    end = start_ms + int(days * DAY_MS)
    for d in range(whole):
        n = _poisson(rng, per_day)
        for _ in range(n):
            hour = rng.choices(range(24), HOUR_WEIGHTS)[0]
            t = start_ms + d * DAY_MS + hour * HOUR_MS + rng.randrange(HOUR_MS)
            if t < end:
                out.append(t)
    return out


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _amount(rng: random.Random, habit: float, factor: float = 1.0) -> float:
    return round(max(0.5, habit * factor * math.exp(rng.gauss(0, 0.45))), 2)


def _event(
    t: int,
    kind: str,
    c: _Customer,
    *,
    country: str,
    amount: float = 0.0,
    card: str | None = None,
    device: str | None = None,
    ip: str | None = None,
    merchant: str | None = None,
    scenario: str | None = None,
) -> dict[str, Any]:
    return {
        "type": kind,
        "account": c.account,
        "card": card,
        "device": device,
        "ip": ip,
        "amount": amount if kind != "login" else 0.0,
        "currency": "EUR",
        "merchant": merchant,
        "country": country,
        "event_time_ms": t,
        "label": int(scenario is not None),
        "scenario": scenario,
    }


def _legit(w: _World, c: _Customer, rng: random.Random) -> list[dict[str, Any]]:
    cfg = w.cfg
    start, days = cfg.start_ms, cfg.days
    end = start + int(days * DAY_MS)
    trip: tuple[int, int, str] | None = None
    if rng.random() < 0.04:
        t0 = start + rng.randrange(int(days * DAY_MS))
        trip = (t0, t0 + rng.randint(2, 7) * DAY_MS, rng.choice(TRAVEL_COUNTRIES))
    new_phone = start + rng.randrange(int(days * DAY_MS)) if rng.random() < 0.03 else None

    def where(t: int) -> tuple[str, str]:
        if trip is not None and trip[0] <= t < trip[1]:
            return trip[2], f"ip-trip-{c.idx:06d}"
        return c.home, c.ip

    def device(t: int) -> str:
        if new_phone is not None and t >= new_phone:
            return f"dev-{c.idx:06d}-new"
        return c.devices[0] if len(c.devices) == 1 or rng.random() < 0.7 else c.devices[1]

    out: list[dict[str, Any]] = []
    for t in _times(rng, start, days, c.logins_per_day):
        country, ip = where(t)
        out.append(_event(t, "login", c, country=country, device=device(t), ip=ip))
    for t in _times(rng, start, days, c.payments_per_day):
        country, ip = where(t)
        big = rng.random() < 0.004
        amount = _amount(rng, c.habit, rng.uniform(8, 25) if big else 1.0)
        card = rng.choice(c.cards)
        if rng.random() < 0.6:  # card present, at a terminal
            shops = w.merchants[country] if country != c.home else c.favourites[:6]
            out.append(
                _event(t, "payment", c, country=country, amount=amount, card=card, merchant=rng.choice(shops))
            )
        else:  # online: a session starts with a login
            dev = device(t)
            login_t = t - rng.randint(20_000, 8 * MINUTE_MS)
            session = partial(_event, c=c, country=country, device=dev, ip=ip)
            if login_t >= start:
                out.append(session(login_t, "login"))
            shop = rng.choice(c.favourites[6:] + w.online[:10])
            out.append(session(t, "payment", amount=amount, card=card, merchant=shop))
    if c.coffee:
        coffee = partial(_event, c=c, card=c.cards[0], merchant=c.favourites[0])
        for t in _times(rng, start, days, 1.0):
            country, _ = where(t)
            out.append(coffee(t, "payment", country=country, amount=round(rng.uniform(2.0, 4.5), 2)))
    for t in _times(rng, start, days, c.transfers_per_day):
        country, ip = where(t)
        # in this order: each draws from rng
        amount, dev = _amount(rng, c.habit, 3.0), device(t)
        beneficiary = f"benef-{(c.idx * 7 + rng.randrange(3)) % max(1, cfg.customers):06d}"
        out.append(
            _event(t, "transfer", c, country=country, amount=amount, device=dev, ip=ip, merchant=beneficiary)
        )
    return [e for e in out if start <= e["event_time_ms"] < end]


def _fraud(w: _World, legit: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    cfg = w.cfg
    start = cfg.start_ms
    span = int(cfg.days * DAY_MS)
    end = start + span
    scale = cfg.fraud_scale * cfg.customers * cfg.days / (2000 * 14)
    out: list[dict[str, Any]] = []
    customers = w.customers

    for _ in range(_poisson(rng, 80 * scale)):  # amount_spike
        c = rng.choice(customers)
        t = start + rng.randrange(span)
        card = rng.choice(c.cards)
        spike = partial(_event, c=c, country=c.home, card=card, scenario="amount_spike")
        for _k in range(rng.randint(1, 3)):
            t += rng.randint(5, 60) * MINUTE_MS
            amount = _amount(rng, c.habit, rng.uniform(6, 20))
            out.append(spike(t, "payment", amount=amount, merchant=rng.choice(w.merchants[c.home])))

    by_account = {c.account: c for c in customers}
    for _ in range(max(1, round(3 * scale))):  # compromised_terminal
        home = rng.choices(HOME_COUNTRIES, HOME_WEIGHTS)[0]
        terminal = w.merchants[home][rng.randrange(6)]
        t0 = start + rng.randrange(max(1, span - 3 * DAY_MS))
        gang = rng.choice(FRAUD_COUNTRIES)
        skimmed = {
            (e["account"], e["card"]): e["event_time_ms"]
            for e in legit
            if e["merchant"] == terminal
            and e["device"] is None
            and t0 <= e["event_time_ms"] < t0 + 2 * DAY_MS
        }
        for (account, card), t_skim in sorted(skimmed.items()):
            if rng.random() >= 0.5:
                continue
            c = by_account[account]
            t = t_skim + rng.randint(1 * DAY_MS, 5 * DAY_MS)
            cloned = partial(_event, c=c, country=gang, card=card, scenario="compromised_terminal")
            for _k in range(rng.randint(2, 5)):
                t += rng.randint(2, 45) * MINUTE_MS
                amount = _amount(rng, c.habit, rng.uniform(1, 4))
                out.append(cloned(t, "payment", amount=amount, merchant=rng.choice(w.merchants[gang])))

    for _ in range(_poisson(rng, 70 * scale)):  # account_takeover
        c = rng.choice(customers)
        t = start + rng.randrange(span)
        dev, ip, country = rng.choice(w.fraud_devices), rng.choice(w.fraud_ips), rng.choice(FRAUD_COUNTRIES)
        takeover = partial(_event, c=c, country=country, device=dev, ip=ip, scenario="account_takeover")
        out.append(takeover(t, "login"))
        for _k in range(rng.randint(1, 3)):
            t += rng.randint(30_000, 15 * MINUTE_MS)
            amount = _amount(rng, c.habit, rng.uniform(5, 30))
            out.append(takeover(t, "transfer", amount=amount, merchant=rng.choice(w.mules)))

    for _ in range(_poisson(rng, 40 * scale)):  # card_testing
        c = rng.choice(customers)
        t = start + rng.randrange(span)
        card = rng.choice(c.cards)
        dev, ip, country = rng.choice(w.fraud_devices), rng.choice(w.fraud_ips), rng.choice(FRAUD_COUNTRIES)
        testing = partial(_event, c=c, country=country, card=card, device=dev, ip=ip, scenario="card_testing")
        for _k in range(rng.randint(4, 10)):
            t += rng.randint(2_000, 15_000)
            amount = round(rng.uniform(0.5, 3.0), 2)
            out.append(testing(t, "payment", amount=amount, merchant=rng.choice(w.online)))
        if rng.random() < 0.5:
            t += rng.randint(1, 10) * MINUTE_MS
            amount = _amount(rng, c.habit, rng.uniform(5, 10))
            out.append(testing(t, "payment", amount=amount, merchant=rng.choice(w.online)))
    return [e for e in out if start <= e["event_time_ms"] < end]


def simulate(cfg: SimConfig | None = None) -> list[dict[str, Any]]:
    """Every event of the period in event-time order, each a RiskEvent dict plus ``label`` and
    ``scenario``; event ids are ``ev<seed>-<n>`` in that order."""
    cfg = cfg or SimConfig()
    w = _World(cfg)
    # the world comes from the seed alone, what happens in it from the seed and the period's start: a
    # later period of the same seed is the same customers going on, never the same days again
    period = f"{cfg.seed}/{cfg.start_ms}"
    events: list[dict[str, Any]] = []
    for c in w.customers:
        events += _legit(w, c, random.Random(f"{period}/legit/{c.idx}"))
    events += _fraud(w, events, random.Random(f"{period}/fraud"))
    events.sort(key=lambda e: (e["event_time_ms"], e["account"], e["type"], e["amount"]))
    for n, e in enumerate(events):
        e["event_id"] = f"ev{cfg.seed}-{n:08d}"
    return events


def disorder(
    events: Iterable[dict[str, Any]], *, share: float, grace_ms: int, late_share: float = 0.0, seed: int = 1
) -> list[dict[str, Any]]:
    """Copies of ``events`` (in the same send order) where a ``share`` of them carry an event time
    1 ms to ``grace_ms - 1`` ms before their account's latest so far (out of order, within the grace
    period) and a ``late_share`` more than ``grace_ms`` before it (late)."""
    rng = random.Random(seed)
    head: dict[str, int] = {}
    out = []
    for e in events:
        e = dict(e)
        h = head.get(e["account"])
        roll = rng.random()
        if h is not None and roll < share:
            e["event_time_ms"] = max(0, h - rng.randint(1, max(1, grace_ms - 1)))
        elif h is not None and roll < share + late_share:
            e["event_time_ms"] = max(0, h - grace_ms - rng.randint(1, 60_000))
        out.append(e)
        t = e["event_time_ms"]
        if h is None or t > h:
            head[e["account"]] = t
    return out


EVENT_FIELDS = (
    "event_id",
    "type",
    "account",
    "card",
    "device",
    "ip",
    "amount",
    "currency",
    "merchant",
    "country",
    "event_time_ms",
)


def as_event(sim: dict[str, Any]) -> dict[str, Any]:
    """The RiskEvent part of a simulated event (no label, no scenario)."""
    return {k: sim[k] for k in EVENT_FIELDS}


def write_jsonl(path: str | Path, events: Iterable[dict[str, Any]], cfg: SimConfig | None = None) -> int:
    """Write events as JSON lines (a first line ``{"sim_config": ...}`` when ``cfg`` is given)."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        if cfg is not None:
            f.write(json.dumps({"sim_config": asdict(cfg)}) + "\n")
        for e in events:
            f.write(json.dumps(e, separators=(",", ":")) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """``(events, sim_config or None)`` from a file written by :func:`write_jsonl`."""
    events, meta = [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            if "sim_config" in obj:
                meta = obj["sim_config"]
            else:
                events.append(obj)
    return events, meta
