import json
import os

import pytest

from reamer.serve.spec import (
    InstanceSpec, JobSpec, JobStatus, SpecError, append_event, is_temp_file, plan_reconcile, read_events,
    write_atomic,
)


def _spec(tmp_path, **kw):
    base = dict(name="j", kind="online", model="/m.onnx", port=0, run_dir=str(tmp_path),
                instances=[InstanceSpec(cpus=[0], threads=1, max_batch=4)])
    base.update(kw)
    return JobSpec(**base)


def test_jobspec_round_trips_through_json(tmp_path):
    spec = _spec(tmp_path, slo_ms=50.0, rate_rps=20.0, frontdoor_cpus=[1],
                 instances=[InstanceSpec([0], 1, 4), InstanceSpec([1], 1, 2, sched="idle")])
    again = JobSpec.from_json(spec.to_json())
    assert again == spec
    assert isinstance(again.instances[1], InstanceSpec) and again.instances[1].sched == "idle"
    spec.save(tmp_path / "spec.json")
    assert JobSpec.load(tmp_path / "spec.json") == spec


@pytest.mark.parametrize("change, words", [
    (dict(kind="sideways"), "kind"),
    (dict(instances=[]), "no instances"),
    (dict(backend="tensorflow"), "backend"),
    (dict(kind="offline", input_dir=None), "input_dir"),
    (dict(port=None), "port"),
])
def test_jobspec_rejects_bad_values_with_a_fix(tmp_path, change, words):
    with pytest.raises(SpecError) as err:
        _spec(tmp_path, **change)
    assert words in err.value.message and err.value.fix


def test_from_json_names_unknown_keys_and_bad_instances(tmp_path):
    data = json.loads(_spec(tmp_path).to_json())
    with pytest.raises(SpecError, match="unknown keys"):
        JobSpec.from_json(json.dumps({**data, "colour": "red"}))
    with pytest.raises(SpecError, match="threads"):
        JobSpec.from_json(json.dumps({**data, "instances": [{"cpus": [0], "threads": 0, "max_batch": 1}]}))
    with pytest.raises(SpecError, match="not valid JSON"):
        JobSpec.from_json("{")
    with pytest.raises(SpecError, match="cannot read"):
        JobSpec.load(tmp_path / "missing.json")


def test_write_atomic_replaces_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "f.json"
    write_atomic(target, "old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["f.json"]


def test_write_atomic_failure_leaves_old_content(tmp_path):
    target = tmp_path / "f"
    write_atomic(target, "old")
    with pytest.raises(TypeError):
        write_atomic(target, 123)  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert not [n for n in os.listdir(tmp_path) if is_temp_file(n)]


def test_events_append_and_read_incrementally(tmp_path):
    append_event(tmp_path, "worker_crashed", "instance 0 crashed", instance=0)
    events, off = read_events(tmp_path / "events.jsonl")
    assert [e["kind"] for e in events] == ["worker_crashed"] and events[0]["instance"] == 0
    append_event(tmp_path, "done", "all done")
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.write(b'{"kind": "par')  # a line still being written
    more, off2 = read_events(tmp_path, off)
    assert [e["kind"] for e in more] == ["done"] and off2 > off
    assert read_events(tmp_path, off2) == ([], off2)
    assert read_events(tmp_path / "nothing.jsonl") == ([], 0)


def test_status_written_atomically_and_read_back(tmp_path):
    st = JobStatus(name="j", pid=1, state="running", done=3, total=10, port=8000)
    st.write(tmp_path)
    back = JobStatus.load(tmp_path / "status.json")
    assert back.done == 3 and back.port == 8000 and back.updated_at > 0


def test_plan_reconcile_keeps_unchanged_restarts_changed():
    a, b, c = InstanceSpec([0], 1, 4), InstanceSpec([1], 1, 4), InstanceSpec([1], 1, 8)
    assert plan_reconcile([a, b], [a, b]) == ([(0, 0), (1, 1)], [], [])
    assert plan_reconcile([a, b], [a, c]) == ([(0, 0)], [1], [1])
    assert plan_reconcile([a, b], [b]) == ([(1, 0)], [], [0])
    assert plan_reconcile([a], [a, b]) == ([(0, 0)], [1], [])
