"""Message classes of `inference.GRPCInferenceService`, built in a descriptor pool of their own.

Not protoc's `*_pb2` modules: those add `inference.ModelInferRequest` etc. to protobuf's default pool, where
tritonclient.grpc defines the same names, and a process importing both would fail ("duplicate symbol").
Message names never travel on the wire, so a private pool serves the same bytes.
"""
from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from reamer.serve.doors.grpc_v2._descriptors import FILE_DESCRIPTOR_SET

SERVICE = "inference.GRPCInferenceService"

_pool = descriptor_pool.DescriptorPool()
for _file in descriptor_pb2.FileDescriptorSet.FromString(FILE_DESCRIPTOR_SET).file:
    _pool.Add(_file)


def _message(name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"inference.{name}"))


ServerLiveRequest = _message("ServerLiveRequest")
ServerLiveResponse = _message("ServerLiveResponse")
ServerReadyRequest = _message("ServerReadyRequest")
ServerReadyResponse = _message("ServerReadyResponse")
ModelReadyRequest = _message("ModelReadyRequest")
ModelReadyResponse = _message("ModelReadyResponse")
ServerMetadataRequest = _message("ServerMetadataRequest")
ServerMetadataResponse = _message("ServerMetadataResponse")
ModelMetadataRequest = _message("ModelMetadataRequest")
ModelMetadataResponse = _message("ModelMetadataResponse")
ModelInferRequest = _message("ModelInferRequest")
ModelInferResponse = _message("ModelInferResponse")
InferTensorContents = _message("InferTensorContents")
InferParameter = _message("InferParameter")
ModelConfigRequest = _message("ModelConfigRequest")
ModelConfigResponse = _message("ModelConfigResponse")
ModelStatisticsRequest = _message("ModelStatisticsRequest")
ModelStatisticsResponse = _message("ModelStatisticsResponse")
DATA_TYPES = {v.name: v.number for v in _pool.FindEnumTypeByName("inference.DataType").values}

# (request, response) of every RPC reamer serves, by method name.
METHODS: dict[str, tuple[type, type]] = {
    "ServerLive": (ServerLiveRequest, ServerLiveResponse),
    "ServerReady": (ServerReadyRequest, ServerReadyResponse),
    "ModelReady": (ModelReadyRequest, ModelReadyResponse),
    "ServerMetadata": (ServerMetadataRequest, ServerMetadataResponse),
    "ModelMetadata": (ModelMetadataRequest, ModelMetadataResponse),
    "ModelInfer": (ModelInferRequest, ModelInferResponse),
    "ModelConfig": (ModelConfigRequest, ModelConfigResponse),
    "ModelStatistics": (ModelStatisticsRequest, ModelStatisticsResponse),
}
