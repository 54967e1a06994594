"""bench/peers.py's bf16 pair: reamer at --precision bf16 against OpenVINO's THROUGHPUT hint at its default
precision, rendered from a run's JSON beside the f32 comparison."""
from __future__ import annotations

from bench import peers


def _row(**extra) -> dict:
    row = {"model": "m", "pick": "2x1:b1@onnxruntime", "load_before": [1.0], "load_after": [1.5], "search_s": 30.0,
           "single": {}, "median_rps": {"reamer": 10.0, "OpenVINO THROUGHPUT hint": 9.5,
                                        "OpenVINO THROUGHPUT hint, default precision": 20.0},
           "peer_info": {"OpenVINO THROUGHPUT hint, default precision": {"precision": "<Type: 'bfloat16'>"}},
           "ratio": 10.0 / 9.5, "best_peer": "OpenVINO THROUGHPUT hint"}
    row.update(extra)
    return row


def test_bf16_pair_has_its_columns_and_its_own_target_line():
    bf16 = _row(pick_bf16="1x2s2:b4@openvino", search_bf16_s=41.0, bf16_effective="bf16", ratio_bf16=21.0 / 20.0)
    bf16["median_rps"]["reamer bf16"] = 21.0
    no_bf16 = _row(model="n", bf16_effective="f32")
    text = peers.render({"command": "c", "machine": {"cpu_model": "test cpu", "cpus": 2}, "cpus": [0, 1],
                         "rounds": 3, "window_s": 0.5, "verify_windows": 3, "rows": [bf16, no_bf16]})
    line = next(t for t in text.splitlines() if t.startswith("| m |"))
    assert "| 1x2s2:b4@openvino 21.00 | 1.05× | 30.0; 41.0 |" in line
    assert "20.00, bfloat16 (0.50×)" in line  # reamer at f32 against the same peer, kept
    assert "(OpenVINO runs f32 here)" in next(t for t in text.splitlines() if t.startswith("| n |"))
    assert "reamer bf16 / OpenVINO THROUGHPUT at its default precision ≥ 1.0: met in 1 of 1" in text
    assert "met in 1 of 2 models" not in text and "Target reamer / best peer ≥ 1.0: met in 2 of 2" in text
