"""Bytes of v2 (Open Inference Protocol) responses with binary outputs, and the plan an instance worker
needs to send one to the client itself.

The REST codec builds its responses here, and so does an instance worker that answers a request on the
client's socket directly (reply-through, see `ReplyPlan`): the answer leaves from the core where the model
just ran instead of waking the job process, whose code and data the model's weights have pushed out of the
shared cache by then. The HTTP head of that answer comes with the plan, made by the door (doors/http_framing).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"
SERVER_NAME = "reamer"
SERVER_VERSION = "0.1.0"
HEADS_CACHE_SIZE = 256


@dataclass
class ReplyPlan:
    """What an instance needs to answer an infer request whose outputs all go binary on the client's
    socket itself (the socket travels beside the batch as a file descriptor)."""

    model_name: str
    request_id: str | None
    outputs: list[tuple[str, str]]  # (name, v2 datatype) in answer order
    # the answer's HTTP head, a %-template of (body length, JSON header length, Server-Timing value), from the
    # door (doors/http_framing.binary_reply_head): the instance fills it in without knowing HTTP
    head_template: bytes
    started: float  # time.perf_counter() when the job took the request: Server-Timing's total
    queue_s: float = 0.0


def server_timing(queue_s: float, compute_s: float, total_s: float) -> str:
    """The W3C Server-Timing header: queue wait, backend compute and the whole request in the job (ms)."""
    return f"queue;dur={queue_s * 1e3:.3f}, compute;dur={compute_s * 1e3:.3f}, total;dur={total_s * 1e3:.3f}"


def le_bytes(a: np.ndarray) -> bytes:
    """The raw bytes of a tensor, C order, little-endian (what the binary extension carries).

    BYTES (object) tensors use Triton's layout: each element as a 4-byte little-endian length and its bytes.
    """
    import numpy as np

    if a.dtype.kind in "OSU":
        items = [x if isinstance(x, bytes) else str(x).encode() for x in a.reshape(-1).tolist()]
        return b"".join(len(x).to_bytes(4, "little") + x for x in items)
    if a.dtype.byteorder != ">" and a.flags.c_contiguous:
        return a.tobytes()
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


def binary_body(model_name: str, request_id: str | None, outputs: list[tuple[str, str, np.ndarray]],
                heads: dict[tuple, bytes] | None = None) -> tuple[bytes, list[bytes]]:
    """The JSON header and the raw little-endian bytes of each output, for outputs all sent binary.

    `heads`, when given, caches JSON headers of requests without an id by output names, types and shapes:
    a hit skips the JSON encoding, which runs just after the model when this process's caches are cold.
    """
    blobs = [le_bytes(a) for _, _, a in outputs]
    key = None
    if heads is not None and request_id is None:
        # the sizes too: a BYTES tensor's bytes vary with its strings, not only with its shape
        key = tuple((name, datatype, a.shape, len(raw)) for (name, datatype, a), raw in zip(outputs, blobs))
        head = heads.get(key)
        if head is not None:
            return head, blobs
    resp: dict = {"model_name": model_name, "model_version": "1",
                  "outputs": [{"name": name, "datatype": datatype, "shape": list(a.shape),
                               "parameters": {"binary_data_size": len(raw)}}
                              for (name, datatype, a), raw in zip(outputs, blobs)]}
    if request_id is not None:
        resp["id"] = request_id
    head = json.dumps(resp).encode()
    if key is not None:
        if len(heads) >= HEADS_CACHE_SIZE:
            heads.clear()
        heads[key] = head
    return head, blobs


def binary_reply(plan: ReplyPlan, outputs: dict[str, np.ndarray], compute_s: float, now: float,
                 heads: dict[tuple, bytes] | None = None) -> list[bytes]:
    """The whole response for `plan` (the door's head, JSON header, tensors), as parts for one gathered write."""
    import numpy as np

    head, blobs = binary_body(plan.model_name, plan.request_id,
                              [(name, datatype, np.asarray(outputs[name])) for name, datatype in plan.outputs], heads)
    length = len(head) + sum(len(b) for b in blobs)
    timing = server_timing(plan.queue_s, compute_s, now - plan.started)
    return [plan.head_template % (length, len(head), timing.encode("latin-1")), head, *blobs]
