"""Which Kafka cluster a worker's table stores belong to (docs/architecture.md,
"Parts and how they start").

A worker's RocksDB stores (``SURGE_DATA_DIR``) remember, for each table partition, the changelog
offset they were written up to. Started against another cluster (a broker whose data folder was
wiped, a new environment) with the old stores, Faust finds offsets that cluster's changelogs never
reached and stops the worker with ``ConsistencyError``, every start. :func:`claim` records the
cluster's id beside the stores on the first start and, when a later start meets another cluster,
moves the old stores aside (nothing is deleted) so the worker restores its tables from this
cluster's changelogs. Pure: paths and strings only.
"""

from __future__ import annotations

import time
from pathlib import Path

#: the file in the data folder that names the cluster its stores were written for
MARKER = "kafka-cluster-id"


def claim(data_dir: Path, cluster_id: str, now_s: float | None = None) -> Path | None:
    """Make ``data_dir`` the stores of cluster ``cluster_id``; returns where stores of another
    cluster were moved (``<data_dir>.cluster-<old id>-<unix time>``), or None. A folder without the
    marker (a first start, or stores from before it was written) is claimed as it is."""
    data_dir.mkdir(parents=True, exist_ok=True)
    marker = data_dir / MARKER
    known = marker.read_text(encoding="utf-8").strip() if marker.exists() else None
    moved = None
    if known is not None and known != cluster_id:
        stamp = int(time.time() if now_s is None else now_s)
        moved = data_dir.with_name(f"{data_dir.name}.cluster-{_safe(known)}-{stamp}")
        data_dir.rename(moved)
        data_dir.mkdir(parents=True)
    if known != cluster_id:
        marker.write_text(cluster_id + "\n", encoding="utf-8")
    return moved


def _safe(cluster_id: str) -> str:
    """``cluster_id`` as part of a folder name (Kafka's ids are base64url, 22 characters)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in cluster_id)[:40] or "unknown"
