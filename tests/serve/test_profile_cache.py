import json
import os
import threading

import pytest

from reamer.plan.partition import ProfilePoint
from reamer.serve.measure.profile_cache import ProfileCache, file_sha256, model_key

POINTS = [ProfilePoint(1, 1, 100.5, 2.5), ProfilePoint(2, 8, 350.0, 11.25)]


@pytest.fixture
def model_file(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(b"model-bytes-v1")
    return p


def test_key_depends_on_bytes_backend_and_cpu_model(model_file, tmp_path):
    k = model_key(model_file, "onnxruntime", "Xeon A")
    assert len(k) == 64
    assert k == model_key(model_file, "onnxruntime", "Xeon A")
    assert k != model_key(model_file, "openvino", "Xeon A")
    assert k != model_key(model_file, "onnxruntime", "EPYC B")
    copy = tmp_path / "renamed.onnx"
    copy.write_bytes(model_file.read_bytes())
    assert model_key(copy, "onnxruntime", "Xeon A") == k  # content, not path
    model_file.write_bytes(b"model-bytes-v2")
    assert model_key(model_file, "onnxruntime", "Xeon A") != k


def test_default_cpu_model_comes_from_this_host(model_file):
    from reamer.host.topology import read_topology

    assert model_key(model_file, "onnxruntime") == model_key(model_file, "onnxruntime", read_topology().model_name)


def test_put_get_round_trip(tmp_path, model_file):
    cache = ProfileCache(tmp_path / "cache")
    key = model_key(model_file, "onnxruntime", "cpu")
    assert cache.get(key) is None
    path = cache.put(key, POINTS, meta={"model": "m.onnx"})
    assert cache.get(key) == POINTS
    assert json.loads(path.read_text())["meta"] == {"model": "m.onnx"}
    assert os.listdir(tmp_path / "cache") == [f"{key}.json"]  # no temp files left behind
    assert ProfileCache(tmp_path / "cache").get(key) == POINTS  # survives a new instance
    assert cache.delete(key) and cache.get(key) is None


def test_corrupt_entry_is_a_miss(tmp_path):
    cache = ProfileCache(tmp_path)
    key = "ab" * 32
    cache.path_for(key).write_text("{not json")
    assert cache.get(key) is None
    cache.path_for(key).write_text(json.dumps({"format": 1, "points": [{"cores": 1}]}))
    assert cache.get(key) is None


def test_bad_key_is_refused(tmp_path):
    with pytest.raises(ValueError):
        ProfileCache(tmp_path).path_for("../../etc/passwd")


def test_concurrent_puts_leave_a_whole_entry(tmp_path):
    cache = ProfileCache(tmp_path)
    key = "cd" * 32
    other = [ProfilePoint(c, 1, float(c), 1.0) for c in range(1, 200)]
    threads = [threading.Thread(target=cache.put, args=(key, POINTS if i % 2 else other)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.get(key) in (POINTS, other)
    assert file_sha256(cache.path_for(key))  # readable
