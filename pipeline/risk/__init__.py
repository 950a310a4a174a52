"""Real-time risk scoring: events, per-entity windowed features, rules, the simulator.

Pure logic only (no Faust, no Kafka): the agent in ``agents/risk.py`` wires it to topics and
RocksDB tables. See docs/architecture.md, "Risk".

* :mod:`pipeline.risk.records`: RiskEvent, RiskDecision and the late-event record.
* :mod:`pipeline.risk.windows`: tiled event-time windows (1 min, 1 h, 24 h).
* :mod:`pipeline.risk.features`: one entity's state and the step that reads and updates it.
* :mod:`pipeline.risk.stages`: the re-keyed chain account → card → device → ip over a state store.
* :mod:`pipeline.risk.rules`: versioned rules over features, and the rule book.
* :mod:`pipeline.risk.decide`: rules + model → approve / review / decline with reasons.
* :mod:`pipeline.risk.reference`: the brute-force recomputation the tests and the benchmark check against.
* :mod:`pipeline.risk.simulate`: the transaction simulator with labelled fraud scenarios.
"""
