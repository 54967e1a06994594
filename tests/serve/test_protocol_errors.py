"""One table of protocol errors (protocol/errors.Fault) and one validator (protocol/validate) for both doors:
each runtime error answers with the HTTP status and gRPC code the doors gave it before, and the same mistake
gets the same message from the REST and the gRPC codec."""
import grpc
import numpy as np
import orjson
import pytest

from reamer.serve.doors.grpc import STATUS
from reamer.serve.doors.grpc_v2 import messages as pb
from reamer.serve.protocol.errors import BadRequest, Fault
from reamer.serve.protocol.grpc_codec import decode_infer_request
from reamer.serve.protocol.rest_codec import decode_request
from reamer.serve.protocol.tensors import TensorInfo
from reamer.serve.runtime.batcher import ModelFault, NotReady, Overloaded, RequestRefused
from reamer.serve.runtime.instances import InferenceFailed, InstanceCrashed, ReplyBroken, WorkerError, WorkerStartError


@pytest.mark.parametrize("error, http, code", [
    (BadRequest("m"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (InferenceFailed("m"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestRefused("m"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelFault("m"), 500, grpc.StatusCode.INTERNAL),
    (Overloaded("m"), 503, grpc.StatusCode.UNAVAILABLE),
    (NotReady("m"), 503, grpc.StatusCode.UNAVAILABLE),
    (WorkerError("m"), 503, grpc.StatusCode.UNAVAILABLE),
    (WorkerStartError("m"), 503, grpc.StatusCode.UNAVAILABLE),
    (InstanceCrashed(0, -9), 503, grpc.StatusCode.UNAVAILABLE),
    (ReplyBroken("m"), 503, grpc.StatusCode.UNAVAILABLE),
])
def test_each_error_has_one_fault_with_its_http_status_and_grpc_code(error, http, code):
    assert error.fault.http == http
    assert STATUS[error.fault] is code


def test_every_fault_names_a_real_grpc_code_and_an_http_error_status():
    assert set(STATUS) == set(Fault)
    assert all(400 <= f.http < 600 for f in Fault)
    assert len({f.name for f in Fault}) == len(Fault)  # no fault is another's alias


INS = [TensorInfo("x", "FP32", [-1, 2]), TensorInfo("ids", "INT64", [-1, 3])]
OUTS = [TensorInfo("y", "FP32", [-1, 2])]


def _both(inputs: list[tuple[str, str, list[int]]], outputs: list[str] = ()) -> tuple[str, str]:
    """The REST and the gRPC codec's message for the same request."""
    body = {"inputs": [{"name": n, "datatype": d, "shape": s, "data": np.zeros(int(np.prod(s))).tolist()}
                       for n, d, s in inputs], "outputs": [{"name": o} for o in outputs]}
    req = pb.ModelInferRequest(model_name="m")
    for n, d, s in inputs:
        req.inputs.add(name=n, datatype=d, shape=s)
        req.raw_input_contents.append(b"\0" * (int(np.prod(s)) * (8 if d == "INT64" else 4)))
    for o in outputs:
        req.outputs.add(name=o)
    with pytest.raises(BadRequest) as rest:
        decode_request(orjson.dumps(body), None, INS, OUTS)
    with pytest.raises(BadRequest) as grpc_:
        decode_infer_request(req, INS, OUTS)
    return rest.value.message, grpc_.value.message


@pytest.mark.parametrize("inputs, outputs, words", [
    ([("nope", "FP32", [1, 2])], [], "unknown input 'nope'"),
    ([("x", "FP32", [1, 2]), ("x", "FP32", [1, 2])], [], "input 'x' is given twice"),
    ([("x", "FP64", [1, 2]), ("ids", "INT64", [1, 3])], [], "input 'x' has datatype 'FP64' but the model expects FP32"),
    ([("x", "FP32", [1, 5]), ("ids", "INT64", [1, 3])], [], "input 'x' has shape [1, 5]"),
    ([("x", "FP32", [1, 2])], [], "missing input(s) ['ids']"),
    ([("x", "FP32", [1, 2]), ("ids", "INT64", [1, 3])], ["nah"], "unknown output 'nah' in outputs[0].name"),
])
def test_the_same_mistake_gets_the_same_message_from_both_codecs(inputs, outputs, words):
    rest, grpc_ = _both(inputs, outputs)
    assert words in rest
    assert rest == grpc_
