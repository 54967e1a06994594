"""`--precision` on `reamer infer deploy` and `reamer search`: bad values refused with the fix (exit 2, no
traceback), aliases accepted, and a real bf16 search that says what it computed in and keeps its points
apart from f32's."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from reamer.cli.main import cli
from reamer.cli.search_cmd import describe_precision
from tests.serve.test_precision import HAS_BF16, models_dir, resnet  # noqa: F401 (fixtures)


@pytest.mark.parametrize("command", [
    ["infer", "deploy", "j", "--online", "--slo-ms", "100", "--precision", "fp8", "--model"],
    ["search", "--cores", "1", "--precision", "fp8"],
])
def test_bad_precision_is_refused_with_the_fix(resnet, command, tmp_path):
    result = CliRunner().invoke(cli, ["--socket", str(tmp_path / "none.sock"), *command, resnet])
    assert result.exit_code == 2, result.output
    assert "'fp8' is not a precision" in result.output and "bf16" in result.output and "f32" in result.output
    assert "Traceback" not in result.output


def test_precision_as_shown():
    assert describe_precision("f32", "f32", "openvino") == "f32"
    assert describe_precision("bf16", "bf16", "openvino") == "bf16"
    assert describe_precision("bf16", "f32", "onnxruntime") == "f32 (asked bf16: onnxruntime computes in f32)"
    assert "no native bf16" in describe_precision("bf16", "f32", "openvino")
    assert "no instance" in describe_precision("bf16", None, "openvino")


def test_search_at_bf16_reports_what_ran_and_keeps_its_points_apart(resnet, tmp_path):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    common = ["-o", "json", "search", resnet, "--cores", "1", "--cpus", str(cpu), "--backend", "openvino",
              "--max-batch", "1", "--warmup-s", "0.05", "--window-s", "0.05", "--max-windows", "3",
              "--verify-windows", "1", "--cache-dir", str(tmp_path / "cache")]
    runner = CliRunner()
    bf16 = runner.invoke(cli, [*common, "--precision", "bfloat16"])
    assert bf16.exit_code == 0, bf16.output
    doc = json.loads(bf16.stdout)
    assert (doc["precision"], doc["effective_precision"]) == ("bf16", "bf16" if HAS_BF16 else "f32")
    assert doc["cached_points"] == 0
    f32 = json.loads(runner.invoke(cli, common).stdout)
    assert (f32["precision"], f32["effective_precision"]) == ("f32", "f32")
    assert f32["cached_points"] == 0, "the f32 search was served the bf16 points"
    again = json.loads(runner.invoke(cli, [*common, "--precision", "bf16"]).stdout)
    assert again["cached_points"] == again["single_instance_points"] > 0
