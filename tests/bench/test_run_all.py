"""`make bench` (bench.run_all) and the shared harness: every figure's bench is in the table, smoke runs never
write RESULTS.md, a bench that cannot run here says why, and the harness helpers the benches share."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness, run_all

ROOT = Path(__file__).resolve().parents[2]


def test_every_bench_quoted_in_results_md_is_run_by_make_bench():
    quoted = set(re.findall(r"-m bench\.([a-z_0-9]+)", (ROOT / "bench" / "RESULTS.md").read_text())) - {"run_all"}
    assert quoted, "RESULTS.md quotes no `python -m bench.NAME` command"
    names = {b.name for b in run_all.BENCHES}
    assert quoted <= names, f"quoted in RESULTS.md but not in bench/run_all.py: {sorted(quoted - names)}"
    for name in names:
        assert (ROOT / "bench" / f"{name}.py").is_file(), name


def test_no_results_md_quotes_the_old_script_form():
    assert not re.findall(r"python bench/[a-z_0-9]+\.py", (ROOT / "bench" / "RESULTS.md").read_text())


def test_no_bench_module_patches_sys_path():
    patched = [p.name for p in (ROOT / "bench").glob("*.py") if "sys.path" in p.read_text()]
    assert patched == []


@pytest.mark.parametrize("bench", [b for b in run_all.BENCHES if b.results_md], ids=lambda b: b.name)
def test_a_smoke_run_never_writes_results_md_and_a_full_run_does(bench, tmp_path):
    smoke = bench.command(False, tmp_path / bench.name, "R.md")
    assert smoke[smoke.index("--results-md") + 1] == ""
    full = bench.command(True, tmp_path / bench.name, "R.md")
    assert full[full.index("--results-md") + 1] == "R.md"
    assert full[1:3] == ["-m", f"bench.{bench.name}"] and list(bench.full) == full[3:3 + len(bench.full)]


def test_list_names_every_bench_and_its_figure_command(capsys):
    assert run_all.main(["--list"]) == 0
    out = capsys.readouterr().out
    for b in run_all.BENCHES:
        assert f"figure: python -m bench.{b.name}" in out


def test_an_unknown_bench_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        run_all.main(["--only", "nope"])
    assert "no bench nope; choose from" in capsys.readouterr().err


def test_a_bench_whose_needs_are_missing_is_left_out_with_the_reason(monkeypatch, capsys, tmp_path):
    missing = run_all.Bench("loopback_floor", (), 0.1, out=None, needs=(lambda: "needs a unicorn",))
    monkeypatch.setattr(run_all, "BENCHES", [missing])
    assert run_all.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "loopback_floor: left out: needs a unicorn; where it can run: python -m bench.loopback_floor" in out
    assert "0 passed, 0 failed, 1 left out: loopback_floor" in out


def test_make_bench_runs_a_bench_as_a_module(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.run_all", "--only", "loopback_floor", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "== loopback_floor: exit 0" in done.stdout and "1 passed, 0 failed, 0 left out" in done.stdout


def test_harness_rounds_medians_and_ratios():
    assert harness.rotated(["a", "b", "c"], 4) == ["b", "c", "a"] and harness.rotated([], 3) == []
    assert harness.spread([9.0, 10.0, 12.0]) == pytest.approx(0.3) and harness.spread([5.0]) == 0.0
    assert harness.ratio(3.0, 2.0) == 1.5 and harness.ratio(3.0, 0.0) is None and harness.ratio(None, 2.0) is None
    assert harness.median([3.0, 1.0, 2.0]) == 2.0 and harness.median([]) != harness.median([])  # NaN
    assert harness.command_line("peers", ["--quick"]) == "python -m bench.peers --quick"
    assert harness.command_and_machine({"command": "c", "machine": {"cpu_model": "x", "cpus": 2}}) == \
        "Command: `c` · machine: x, 2 cpus"


def test_write_json_makes_its_folder_and_leaves_no_temporary_file(tmp_path):
    path = harness.write_json(tmp_path / "a" / "run.json", {"p": Path("/x"), "n": 1})
    assert json.loads(path.read_text()) == {"p": "/x", "n": 1}
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]
