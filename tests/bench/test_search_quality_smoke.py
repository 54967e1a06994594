"""Smoke run of the layout-search quality bench (simulator study only) and of its RESULTS.md helper."""
from __future__ import annotations

import json

import pytest

from bench import harness
from bench import search_quality

# A small calibration with the shape bench/search_calibration.py writes (1- and 2-core points, contention).
CALIBRATION = {"models": {"m": {
    "points": [{"cores": c, "batch": b, "throughput_rps": 1000.0 * b / ms, "p99_ms": 1.4 * ms}
               for c, table in ((1, {1: 40.0, 2: 70.0, 4: 130.0, 8: 250.0, 16: 490.0, 32: 980.0}),
                                (2, {1: 28.0, 2: 45.0, 4: 80.0, 8: 150.0, 16: 290.0, 32: 570.0}))
               for b, ms in table.items()],
    "contention": [{"batch": 1, "factor": 0.9}, {"batch": 8, "factor": 0.8}]}}}


def test_quick_study_writes_json_and_its_section(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CALIBRATION))
    md = tmp_path / "RESULTS.md"
    md.write_text("# results\n\n## Other bench\n\nkept\n\n<!-- bench:x:begin -->\n## X\nmarked\n<!-- bench:x:end -->\n")
    args = ["--quick", "--calibration", str(cal), "--out", str(tmp_path / "out"), "--results-md", str(md)]
    assert search_quality.main(args) == 0
    data = json.loads((tmp_path / "out" / "search_quality.json").read_text())
    (row,) = data["rows"]
    assert row["cores"] == 16 and row["slo_ms"] is None and row["space"] == 231 * 6
    assert 0 < row["measured"] == row["points"] + row["layouts"] < row["space"]
    assert 0.0 < row["ratio"] <= 1.0 + 1e-9  # scored against the exact best: cannot beat it
    assert row["enumeration_agrees"] is True
    (summary,) = data["summary"]
    assert summary["model"] == "m" and summary["worst_ratio"] == row["ratio"]
    assert data["real_skipped"] is True

    assert search_quality.main(args) == 0  # a second run replaces its section, never duplicates it
    text = md.read_text()
    assert text.count(search_quality.SECTION) == 1 and text.count(search_quality.SUBSECTION) == 1
    assert "## Other bench\n\nkept" in text and "<!-- bench:x:begin -->\n## X\nmarked" in text
    body = harness.read_section(md, search_quality.SUBSECTION)
    assert "| m | 16 |" in body and "Real 2-core check: skipped" in body


def test_replace_section_keeps_other_sections(tmp_path):
    md = tmp_path / "R.md"
    md.write_text("# t\n\n## A\n\nold a\n\n### A1\n\nsub\n\n## B\n\n```\n## not a heading\n```\nb\n")
    harness.replace_section(md, "## A", "new a")
    assert md.read_text() == "# t\n\n## A\n\nnew a\n\n## B\n\n```\n## not a heading\n```\nb\n"
    harness.replace_section(md, "## B", "new b")
    assert harness.read_section(md, "## B") == "new b"
    harness.replace_section(md, "### C1", "c1", parent="## C")
    harness.replace_section(md, "### A2", "a2", parent="## A")
    assert harness.read_section(md, "## A") == "new a\n\n### A2\n\na2"
    assert harness.read_section(md, "## C") == "### C1\n\nc1"
    assert harness.read_section(md, "## missing") is None
    with pytest.raises(ValueError, match="heading"):
        harness.replace_section(md, "A", "x")
