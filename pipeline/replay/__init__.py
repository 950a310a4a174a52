"""Replay recorded topic history through another model or settings, and compare with what live
traffic got; mirror a share of live traffic to a candidate model (shadow). docs/architecture.md,
"Replay".

* :mod:`pipeline.replay.plan`: pure: times, the range of offsets, replay names, throttle, sampling,
  the rewrite of a copied request;
* :mod:`pipeline.replay.compare`: pure: the comparison report (agreement, edit distance, causes,
  score deltas, feature mismatches, latency, recall at 1 % false positives);
* :mod:`pipeline.replay.plot`: the report's PNG;
* :mod:`pipeline.replay.runner`: the Kafka side of ``surge replay`` (read the range without a group,
  copy it into the replay's own topics, run an isolated worker, collect, compare);
* :mod:`pipeline.replay.shadow`: ``surge shadow``.
"""
