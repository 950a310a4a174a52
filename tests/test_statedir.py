"""Which cluster a worker's table stores belong to: pipeline.statedir."""

from __future__ import annotations

from pathlib import Path

from pipeline.statedir import MARKER, claim


def test_the_first_start_claims_the_folder_and_later_ones_on_that_cluster_keep_it(tmp_path: Path) -> None:
    data = tmp_path / ".surge-data"
    assert claim(data, "cluster-A", now_s=1) is None
    (data / "store").mkdir()
    assert claim(data, "cluster-A", now_s=2) is None
    assert (data / "store").is_dir() and (data / MARKER).read_text().strip() == "cluster-A"


def test_stores_of_another_cluster_are_moved_aside_not_deleted(tmp_path: Path) -> None:
    """Started on a fresh broker with the stores of the old one, both workers of the review
    stopped with Faust's ConsistencyError (persisted offset 331 > the new changelog's -1), at
    every start."""
    data = tmp_path / ".surge-data"
    claim(data, "old/cluster+id", now_s=1)
    (data / "store").mkdir()
    (data / "store" / "offsets").write_text("331")
    moved = claim(data, "new-cluster", now_s=1_700_000_000)

    assert moved == tmp_path / ".surge-data.cluster-old_cluster_id-1700000000"
    assert (moved / "store" / "offsets").read_text() == "331"
    assert sorted(p.name for p in data.iterdir()) == [MARKER]
    assert (data / MARKER).read_text().strip() == "new-cluster"


def test_stores_written_before_the_marker_existed_are_claimed_as_they_are(tmp_path: Path) -> None:
    data = tmp_path / "d"
    (data / "store").mkdir(parents=True)
    assert claim(data, "c", now_s=1) is None
    assert (data / "store").is_dir()
