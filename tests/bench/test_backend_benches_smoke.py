"""Smoke runs of issue 14's benches that need no long measurement: the search-quality study over both
backends (simulator), and the RESULTS sections of bench/peers.py and bench/mlserver_peer.py from run JSON."""
from __future__ import annotations

import copy
import json

from bench import mlserver_peer, peers, search_quality
from tests.bench.test_search_quality_smoke import CALIBRATION

from reamer.plan.layout import parse_layout


def test_auto_study_scores_picks_on_both_backends(tmp_path):
    cal = copy.deepcopy(CALIBRATION)
    faster = copy.deepcopy(cal["models"]["m"])
    for p in faster["points"]:
        p["throughput_rps"] *= 1.2 if p["cores"] == 2 else 0.9
    faster["streams"] = [{"batch": 1, "factor": 1.05}]
    cal["backends"] = {"openvino": {"models": {"m": faster}}}
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    args = ["--backends", "auto", "--calibration", str(tmp_path / "cal.json"), "--cores", "16", "--slos", "none,500",
            "--noise", "0", "--out", str(tmp_path / "out"), "--results-md", ""]
    assert search_quality.main(args) == 0
    data = json.loads((tmp_path / "out" / "search_quality_auto.json").read_text())
    assert data["backends"] == "auto" and len(data["rows"]) == 2
    for row in data["rows"]:
        assert row["backends"] == ["onnxruntime", "openvino"]
        assert parse_layout(row["quick_layout"]).backend in ("onnxruntime", "openvino")
        assert 0.97 <= row["ratio"] <= 1.0 + 1e-9 and row["measured"] == row["points"] + row["layouts"]
    assert "Picks by backend" in search_quality.render(data)


def _machine():
    return {"cpu_model": "test cpu", "cpus": 2}


def test_peers_and_mlserver_sections_render_from_json(tmp_path):
    row = {"model": "m", "pick": "2x1:b1@openvino", "load_before": [1.0], "load_after": [1.5], "search_s": 30.0,
           "single": {"onnxruntime": "1x2:b4@onnxruntime"},
           "median_rps": {"reamer": 10.0, "best onnxruntime layout": 9.0, "OpenVINO THROUGHPUT hint": 9.5,
                          "OpenVINO THROUGHPUT hint, default precision": 20.0, "ORT default session b1": 8.0},
           "peer_info": {"OpenVINO THROUGHPUT hint": {"streams": 2, "requests": 2, "precision": "f32"},
                         "OpenVINO THROUGHPUT hint, default precision": {"streams": 2, "requests": 2,
                                                                          "precision": "bf16"}},
           "ratio": 10.0 / 9.5, "best_peer": "OpenVINO THROUGHPUT hint", "ratio_vs_ov_default_precision": 0.5}
    text = peers.render({"command": "c", "machine": _machine(), "cpus": [0, 1], "rounds": 3, "window_s": 0.5,
                         "verify_windows": 3, "rows": [row, {"model": "x", "error": "no layout"}]})
    assert "| m | 2x1:b1@openvino | 10.00 |" in text and "1.05×" in text and "bf16" in text
    assert "met in 1 of 1" in text
    ml = {"command": "c", "machine": _machine(), "cpus": [0, 1], "client_cpu": 0, "rounds": 2, "seconds": 5,
          "rows": [{"model": "m", "load_before": [1.0], "load_after": [2.0],
                    "median": {"mlserver JSON": {"rps_c4": 2.0, "p50_ms_c1": 100.0},
                               "reamer JSON": {"rps_c4": 3.0, "p50_ms_c1": 80.0}}}]}
    text = mlserver_peer.render(ml)
    assert "1.50×" in text and "0.80" in text
