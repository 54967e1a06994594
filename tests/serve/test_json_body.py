"""The simdjson read of large JSON bodies (reamer.serve.protocol.json_body) gives exactly what the general path (orjson,
numpy) gives: the same array, or the same 400 message, for every body it might see."""
import json

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reamer.serve.protocol import rest_codec
from reamer.serve.protocol.errors import BadRequest
from reamer.serve.protocol.rest_codec import decode_request
from reamer.serve.protocol.json_body import FloatData, read_large_request
from reamer.serve.protocol.tensors import TensorInfo

N = 3 * 64 * 64  # over LARGE_JSON_BYTES as JSON text


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
    ("int-past-2**53", "FP32", _with(4, 2 ** 53 + 1)),
    ("all-ints", "FP32", list(range(N))),
    ("evenly-nested", "FP32", [_floats()]),
    ("uneven-nested-that-flattens-to-N", "FP32", _with(0, [1.5, 2.5])[:-1] + [[]]),
    ("ints-for-int64", "INT64", list(range(N))),
    ("float-for-int64", "INT64", _with(2, 2.5, 0)[:0] + [2.5] + list(range(N - 1))),
]


def _decode(body: bytes, datatype: str = "FP32"):
    ins = [TensorInfo("x", datatype, [-1, N])]
    outs = [TensorInfo("y", datatype, [-1, 1])]
    try:
        return decode_request(body, None, ins, outs, {}, 64 << 20).inputs["x"]
    except BadRequest as exc:
        return str(exc)


def _general(monkeypatch, body: bytes, datatype: str):
    with monkeypatch.context() as m:
        m.setattr(rest_codec, "LARGE_JSON_BYTES", 1 << 62)  # the simdjson read off
        return _decode(body, datatype)


@pytest.mark.parametrize("case, datatype, data", CASES, ids=[c[0] for c in CASES])
def test_the_simdjson_read_answers_as_the_general_path(monkeypatch, case, datatype, data):
    _same_answer(monkeypatch, _body(datatype, data), datatype)


def _same_answer(monkeypatch, body: bytes, datatype: str = "FP32"):
    assert len(body) > rest_codec.LARGE_JSON_BYTES
    fast, general = _decode(body, datatype), _general(monkeypatch, body, datatype)
    if isinstance(general, str):
        assert fast == general
    else:
        assert isinstance(fast, np.ndarray), fast
        assert fast.dtype == general.dtype and fast.shape == general.shape
        np.testing.assert_array_equal(fast, general)




def test_an_empty_data_list_in_a_large_body(monkeypatch):
    body = _body("FP32", [], parameters={"padding": "x" * (1 << 17)})
    assert isinstance(_data_read(body), FloatData)
    _same_answer(monkeypatch, body)


@pytest.mark.parametrize("data", [7, None, "1.5", {"a": [1.5]}])
def test_data_that_is_not_a_list(monkeypatch, data):
    _same_answer(monkeypatch, _body("FP32", data, parameters={"padding": "x" * (1 << 17)}))


def _data_read(body: bytes, datatype: str = "FP32"):
    req = read_large_request(body, {"x"} if datatype.startswith("FP") else set())
    return None if req is None else req["inputs"][0]["data"]


def test_a_flat_float_list_is_read_without_python_floats():
    data = _data_read(_body("FP32", _floats()))
    assert isinstance(data, FloatData) and data.values.dtype == np.float64
    np.testing.assert_array_equal(data.values, np.asarray(_floats()))


@pytest.mark.parametrize("datatype, data", [
    ("FP32", [_floats()]),  # nested: the general path checks its shape
    ("FP32", _with(9, True)),  # a non-number: the general path names it
    ("FP32", _with(4, 2 ** 53 + 1)),  # may not read back exactly through float64
    ("INT64", list(range(N))),  # integers stay integers
])
def test_what_is_not_a_flat_list_of_exact_floats_goes_to_the_general_path_as_a_list(datatype, data):
    read = _data_read(_body(datatype, data), datatype)
    assert isinstance(read, list) and read == data


@pytest.mark.parametrize("body", [
    b"\xef\xbb\xbf" + _body("FP32", _floats()),  # orjson refuses a byte order mark, simdjson would skip it
    _body("FP32", _floats())[:-1],  # cut off
    _body("FP32", _floats()).replace(b"]", b"]] ", 1),  # malformed
])
def test_bodies_simdjson_would_treat_otherwise_are_left_to_orjson(monkeypatch, body):
    assert read_large_request(body, {"x"}) is None
    _same_answer(monkeypatch, body)


def test_an_escaped_bracket_cannot_hide_a_nested_list(monkeypatch):
    """A name written with \\u005b has one "[" fewer in the body than in the request written back: without the
    backslash rule it would make up for the nested list in the data, which simdjson would flatten."""
    head = '{"id": "\\u005b", "inputs": [{"name": "x", "shape": [1, %d], "datatype": "FP32", "data": %s}]}'
    body = (head % (N, json.dumps(_with(0, [1.5])[:-1] + [2.5]))).encode()
    assert isinstance(_data_read(body), list)
    _same_answer(monkeypatch, body)


@pytest.mark.parametrize("first, last", [('["1.5"]', "floats"), ("floats", '["1.5"]'), ("floats", "7")])
def test_with_a_key_given_twice_the_last_wins_as_in_orjson(monkeypatch, first, last):
    floats = json.dumps(_floats())
    head = '{"inputs": [{"name": "x", "shape": [1, %d], "datatype": "FP32", "data": %s, "data": %s}]}'
    body = (head % (N, floats if first == "floats" else first, floats if last == "floats" else last)).encode()
    _same_answer(monkeypatch, body)
    inputs_twice = b'{"inputs": [], ' + body[1:]
    _same_answer(monkeypatch, inputs_twice)


_scalar = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.floats(-1e6, 1e6),
                    st.integers(-(2**70), 2**70), st.integers(-1000, 1000), st.booleans(), st.none(),
                    st.text(max_size=3))
_element = st.one_of(_scalar, st.lists(_scalar, max_size=3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(datatype=st.sampled_from(["FP32", "FP16", "FP64", "INT64", "INT32", "UINT8"]),
       floats=st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=50),
       odd=st.lists(st.tuples(st.integers(0, 49), _element), max_size=3),
       escaped=st.booleans())
def test_any_mix_of_values_reads_as_the_general_path_reads_it(datatype, floats, odd, escaped):
    data: list = list(floats)
    for at, value in odd:
        data[at % len(data)] = value
    doc = {"id": "a\\\"b" if escaped else "ab", "parameters": {"padding": "x" * (1 << 17)},
           "inputs": [{"name": "x", "shape": [1, len(data)], "datatype": datatype, "data": data}]}
    body = json.dumps(doc, ensure_ascii=False).encode()
    ins = [TensorInfo("x", datatype, [-1, -1])]
    outs = [TensorInfo("y", datatype, [-1, 1])]

    def decode():
        try:
            return decode_request(body, None, ins, outs, {}, 64 << 20).inputs["x"]
        except BadRequest as exc:
            return str(exc)

    fast = decode()
    saved = rest_codec.LARGE_JSON_BYTES
    rest_codec.LARGE_JSON_BYTES = 1 << 62  # the simdjson read off (hypothesis does not take pytest's monkeypatch)
    try:
        general = decode()
    finally:
        rest_codec.LARGE_JSON_BYTES = saved
    if isinstance(general, str):
        assert fast == general
    else:
        assert isinstance(fast, np.ndarray) and fast.dtype == general.dtype and fast.shape == general.shape
        np.testing.assert_array_equal(fast, general)
