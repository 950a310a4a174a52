"""``python -m pipeline.devtools.gpu_check --smoke`` on the CPU: the GPU check cannot rot between the
runs on a GPU machine, and what it checks holds on the CPU too (the GPU-only sections say so)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.devtools import gpu_check


def test_the_smoke_run_passes_every_section_and_reports_what_it_checked(tmp_path: Path) -> None:
    out, png = tmp_path / "gpu_check.json", tmp_path / "gpu_check.png"
    assert gpu_check.main(["--smoke", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert [s for s in gpu_check.SECTIONS if "error" in report[s]] == []
    emb = report["embedder"]
    assert emb["cpu_vs_device_min_cosine"] > 0.9999
    assert all(qps > 0 for qps in emb["device_qps_by_call"].values())
    assert report["faq"]["same_intent_share"] == 1.0 and report["faq"]["device_limit_qps"] > 0
    causal = report["causal"]
    assert causal["greedy_repeats"] and causal["greedy_rows_in_sampled_batch_equal"] and causal["logprobs_ok"]
    assert set(report["batching"]["by_batch"]) == {"1", "4"}
    if not report["env"]["cuda_available"]:
        assert "skipped" in report["oom_split"] and "needs CUDA" in report["int8"]["skipped"]
    assert png.stat().st_size > 10_000


def test_an_unknown_section_is_refused_with_exit_status_2(tmp_path: Path) -> None:
    assert gpu_check.main(["--sections", "env,warp", "--json", str(tmp_path / "x.json")]) == 2


def test_a_section_without_the_one_it_builds_on_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.json"
    assert gpu_check.main(["--sections", "oom_split", "--json", str(out)]) == 2
    assert "oom_split needs batching before it" in capsys.readouterr().err
    assert gpu_check.main(["--sections", "int8,batching", "--json", str(out)]) == 2
    assert gpu_check.main(["--sections", "env,faq", "--json", str(out)]) == 2
    assert not out.exists()
    assert gpu_check.missing_needs(["embedder", "faq", "batching", "oom_split", "int8"]) == []


def test_the_questions_are_distinct_so_no_cache_or_merge_shortens_a_timing() -> None:
    assert len(set(gpu_check.questions(5000))) == 5000
