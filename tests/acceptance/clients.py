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


CLIENTS: dict[str, InferenceClient] = {"http": TritonHttp()}

CLIENT_VARIANTS: list[tuple[str, str]] = [(name, variant) for name, client in CLIENTS.items()
                                          for variant in client.variants]
