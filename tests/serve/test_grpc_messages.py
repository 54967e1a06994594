"""The checked-in gRPC descriptors: wire-compatible with what tritonclient.grpc sends and reads, and what
the .proto files here compile to."""
from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from reamer.serve.doors.grpc_v2 import messages as pb
from reamer.serve.doors.grpc_v2._descriptors import FILE_DESCRIPTOR_SET


def _fields(descriptor, seen=None) -> dict:
    """name -> (number, type, repeated, nested fields) of a message, recursively (what the wire depends on)."""
    seen = set() if seen is None else seen
    if descriptor.full_name in seen:
        return {}
    seen = seen | {descriptor.full_name}
    out = {}
    for f in descriptor.fields:
        nested = _fields(f.message_type, seen) if f.message_type is not None else None
        out[f.name] = (f.number, f.type, f.is_repeated if hasattr(f, "is_repeated") else f.label == 3, nested)
    return out


def _subset(ours: dict, theirs: dict, where: str) -> None:
    for name, (number, ftype, repeated, nested) in ours.items():
        assert name in theirs, f"{where}.{name} is not in tritonclient's message"
        t_number, t_type, t_repeated, t_nested = theirs[name]
        assert (number, ftype, repeated) == (t_number, t_type, t_repeated), f"{where}.{name} differs"
        if nested is not None:
            _subset(nested, t_nested, f"{where}.{name}")


@pytest.mark.parametrize("method", sorted(pb.METHODS))
def test_every_served_message_is_wire_compatible_with_tritonclient(method):
    ours_req, ours_resp = pb.METHODS[method]
    for ours in (ours_req, ours_resp):
        theirs = getattr(service_pb2, ours.DESCRIPTOR.name)
        _subset(_fields(ours.DESCRIPTOR), _fields(theirs.DESCRIPTOR), ours.DESCRIPTOR.name)


def test_data_types_match_tritons_enum():
    theirs = {v.name: v.number for v in model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"].values}
    assert pb.DATA_TYPES == theirs


def test_descriptors_are_what_the_protos_compile_to():
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to recompile the .proto files")
    from reamer.serve.doors.grpc_v2.regenerate import compile_protos

    assert compile_protos() == FILE_DESCRIPTOR_SET, \
        "the .proto files changed: run `python -m reamer.serve.doors.grpc_v2.regenerate`"
