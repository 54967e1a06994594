"""The fast read of large JSON float tensors (frontdoor._flat_floats) gives exactly what the general path
gives: the same array, or the same 400 message, for every body it might see."""
import json

import numpy as np
import orjson
import pytest

from reamer.serve import frontdoor
from reamer.serve.frontdoor import BadRequest, _flat_floats, _plain_data, decode_request
from reamer.serve.tensors import TensorInfo

N = 3 * 64 * 64  # over PLAIN_CHECK_BYTES as JSON text


def _body(datatype: str, data, **extra) -> bytes:
    doc = {"inputs": [{"name": "x", "shape": [1, N], "datatype": datatype, "data": data}], **extra}
    return json.dumps(doc, ensure_ascii=False).encode()


def _floats(seed=0):
    return np.random.default_rng(seed).standard_normal(N).tolist()


def _with(index, value, seed=0):
    data = _floats(seed)
    data[index] = value
    return data


CASES = [
    ("plain", "FP32", _floats()),
    ("plain-fp64", "FP64", _floats(1)),
    ("plain-fp16", "FP16", _floats(2)),
    ("ints-inside", "FP32", _with(7, 3)),
    ("bool-inside", "FP32", _with(9, True)),
    ("numeric-string", "FP32", _with(N // 2, "1.5")),
    ("nan-string", "FP32", _with(N - 1, "nan")),
    ("null", "FP32", _with(5, None)),
    ("object", "FP32", _with(5, {})),
    ("nested", "FP32", _with(5, [1.0])),
    ("int-past-int64", "FP32", _with(3, 10 ** 30)),
    ("int-past-uint64", "FP64", _with(3, 2 ** 70)),
    ("too-large-fp32", "FP32", _with(11, 1e300)),
    ("too-large-fp16", "FP16", _with(11, 70000.0)),
    ("large-fp64", "FP64", _with(11, 1e300)),
    ("starts-with-int", "FP32", [1] + _floats()[1:]),
    ("short", "FP32", _floats()[:-1]),
]


def _decode(body: bytes, datatype: str):
    ins = [TensorInfo("x", datatype, [-1, N])]
    outs = [TensorInfo("y", datatype, [-1, 1])]
    try:
        return decode_request(body, None, ins, outs, {}, 64 << 20).inputs["x"]
    except BadRequest as exc:
        return str(exc)


def _general(monkeypatch, body: bytes, datatype: str):
    with monkeypatch.context() as m:
        m.setattr(frontdoor, "PLAIN_CHECK_BYTES", 1 << 62)  # the fast read off
        return _decode(body, datatype)


@pytest.mark.parametrize("case, datatype, data", CASES, ids=[c[0] for c in CASES])
def test_the_fast_read_answers_as_the_general_path(monkeypatch, case, datatype, data):
    body = _body(datatype, data)
    assert len(body) > frontdoor.PLAIN_CHECK_BYTES
    fast, general = _decode(body, datatype), _general(monkeypatch, body, datatype)
    if isinstance(general, str):
        assert fast == general
    else:
        assert isinstance(fast, np.ndarray), fast
        assert fast.dtype == general.dtype and fast.shape == general.shape
        np.testing.assert_array_equal(fast, general)


def test_a_plain_float_body_takes_the_fast_read():
    body = _body("FP32", _floats())
    req = orjson.loads(body)
    assert _plain_data(body, req)
    fast = _flat_floats(req["inputs"][0]["data"], np.dtype(np.float32))
    assert fast is not None and fast.dtype == np.float32
    np.testing.assert_array_equal(fast, np.asarray(req["inputs"][0]["data"], dtype=np.float32))


@pytest.mark.parametrize("extra, plain", [
    ({}, True),
    ({"id": "a \"quoted\" id"}, False),  # a backslash in the body: not compared
    ({"id": "caf\u00e9", "parameters": {"k": "v"}}, True),
    ({"outputs": [{"name": "y", "parameters": {"binary_data": False}}]}, True),
])
def test_strings_outside_the_data_leave_the_fast_read_on_unless_escaped(extra, plain):
    body = _body("FP32", _floats(), **extra)
    assert _plain_data(body, orjson.loads(body)) is plain


def test_a_string_in_a_data_list_that_json_later_replaces_still_turns_the_fast_read_off():
    head = '{"inputs": [{"name": "x", "shape": [1, %d], "datatype": "FP32", "data": ["1.5"], "data": %s}]}'
    body = (head % (N, json.dumps(_floats()))).encode()
    req = orjson.loads(body)
    assert not _plain_data(body, req)
    assert isinstance(_decode(body, "FP32"), np.ndarray)
