"""The standard clients the acceptance suite talks to online jobs with, one class per transport.

Every test of `test_exported_online.py` runs once per (client, variant) listed in `CLIENT_VARIANTS`:
to judge another transport (gRPC with tritonclient.grpc), add a class with the same `infer` and put it
in `CLIENTS`; the online tests then cover it for every exported model and backend.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class InferenceClient(Protocol):
    """A standard Open Inference Protocol client, on one online job."""

    variants: tuple[str, ...]  # ways of sending the same request (encodings); each is its own test case

    def infer(self, job: Any, model: str, inputs: dict[str, np.ndarray], outputs: list[str],
              variant: str) -> dict[str, np.ndarray]:
        """Send one request to `job` (the API's InferenceJob) for `model`; every asked output by name."""
        ...


def triton_dtype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


class TritonHttp:
    """tritonclient.http, with inputs and outputs as binary tensors or JSON, in every combination."""

    variants = ("binary-in/binary-out", "binary-in/json-out", "json-in/binary-out", "json-in/json-out")

    def infer(self, job: Any, model: str, inputs: dict[str, np.ndarray], outputs: list[str],
              variant: str) -> dict[str, np.ndarray]:
        import tritonclient.http as http

        binary_in, binary_out = (part.startswith("binary") for part in variant.split("/"))
        tensors = []
        for name, array in inputs.items():
            tensor = http.InferInput(name, list(array.shape), triton_dtype(array))
            tensor.set_data_from_numpy(array, binary_data=binary_in)
            tensors.append(tensor)
        asked = [http.InferRequestedOutput(name, binary_data=binary_out) for name in outputs]
        client = http.InferenceServerClient(f"127.0.0.1:{job.port}", connection_timeout=60, network_timeout=60)
        try:
            result = client.infer(model, tensors, outputs=asked)
            return {name: result.as_numpy(name) for name in outputs}
        finally:
            client.close()


class TritonGrpc:
    """tritonclient.grpc on the job's gRPC port (it always sends raw_input_contents and reads raw outputs)."""

    variants = ("raw",)

    def infer(self, job: Any, model: str, inputs: dict[str, np.ndarray], outputs: list[str],
              variant: str) -> dict[str, np.ndarray]:
        import tritonclient.grpc as grpcclient

        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), triton_dtype(array))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        asked = [grpcclient.InferRequestedOutput(name) for name in outputs]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{job.grpc_port}")
        try:
            result = client.infer(model, tensors, outputs=asked, client_timeout=60)
            return {name: result.as_numpy(name) for name in outputs}
        finally:
            client.close()


class KServeGrpc:
    """A plain KServe-v2 gRPC client (messages of grpc_predict_v2.proto) sending typed `contents`, which the
    job answers in kind; a model with an FP16 input goes raw, since FP16 has no typed field."""

    variants = ("typed",)

    def infer(self, job: Any, model: str, inputs: dict[str, np.ndarray], outputs: list[str],
              variant: str) -> dict[str, np.ndarray]:
        import grpc

        from reamer.serve.protocol.grpc_codec import CONTENTS_FIELD
        from reamer.serve.doors.grpc_v2 import messages as pb
        from reamer.serve.protocol.tensors import v2_to_numpy

        request = pb.ModelInferRequest(model_name=model)
        raw = any(triton_dtype(a) not in CONTENTS_FIELD for a in inputs.values())
        for name, array in inputs.items():
            item = request.inputs.add(name=name, datatype=triton_dtype(array), shape=list(array.shape))
            if raw:
                request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
            else:
                getattr(item.contents, CONTENTS_FIELD[item.datatype]).extend(array.ravel().tolist())
        for name in outputs:
            request.outputs.add(name=name)
        with grpc.insecure_channel(f"127.0.0.1:{job.grpc_port}") as channel:
            answer = channel.unary_unary(f"/{pb.SERVICE}/ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                         response_deserializer=pb.ModelInferResponse.FromString)(request, timeout=60)
        got = {}
        for i, out in enumerate(answer.outputs):
            dtype = v2_to_numpy(out.datatype)
            if answer.raw_output_contents:
                flat = np.frombuffer(answer.raw_output_contents[i], dtype=dtype.newbyteorder("<")).astype(dtype)
            else:
                flat = np.array(getattr(out.contents, CONTENTS_FIELD[out.datatype]), dtype=dtype)
            got[out.name] = flat.reshape(list(out.shape))
        return got


CLIENTS: dict[str, InferenceClient] = {"http": TritonHttp(), "grpc": TritonGrpc(), "kserve-grpc": KServeGrpc()}

CLIENT_VARIANTS: list[tuple[str, str]] = [(name, variant) for name, client in CLIENTS.items()
                                          for variant in client.variants]
