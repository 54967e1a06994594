"""Whether an online job's front doors answer, asked as a client asks: REST `GET /v2/health/ready` (200) and gRPC
`ServerReady` (ready: true). `infer deploy` returns "running" only once both do."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class DoorAnswer:
    door: str  # "REST" | "gRPC"
    ready: bool
    detail: str  # what was asked and what came back (for the error when it never answers)


def probe_host(bind_address: str | None) -> str:
    """Where this node reaches a front door that listens on `bind_address` (every interface: loopback)."""
    if not bind_address:
        return "127.0.0.1"
    address = ipaddress.ip_address(bind_address)
    if address.is_unspecified:
        return "::1" if address.version == 6 else "127.0.0.1"
    return bind_address


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rest_ready(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> DoorAnswer:
    import httpx

    url = f"http://{_hostport(host, port)}/v2/health/ready"
    try:
        code = httpx.get(url, timeout=timeout_s).status_code
    except httpx.HTTPError as error:
        return DoorAnswer("REST", False, f"GET {url}: {type(error).__name__}: {error or 'no answer'}")
    return DoorAnswer("REST", code == 200, f"GET {url}: HTTP {code}")


def grpc_ready(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> DoorAnswer:
    import grpc

    from reamer.serve.doors.grpc_v2.messages import SERVICE, ServerReadyRequest, ServerReadyResponse

    target = _hostport(host, port)
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/{SERVICE}/ServerReady", request_serializer=ServerReadyRequest.SerializeToString,
                                   response_deserializer=ServerReadyResponse.FromString)
        try:
            answer = call(ServerReadyRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            return DoorAnswer("gRPC", False, f"ServerReady on {target}: {error.code().name}")
    return DoorAnswer("gRPC", bool(answer.ready), f"ServerReady on {target}: ready={bool(answer.ready)}")


def front_doors(bind_address: str | None, port: int | None, grpc_port: int | None) -> list[DoorAnswer]:
    """Ask every front door the job has; a door whose port is not known yet has not answered."""
    host = probe_host(bind_address)
    answers = [rest_ready(host, port) if port else DoorAnswer("REST", False, "no REST port yet")]
    answers.append(grpc_ready(host, grpc_port) if grpc_port else DoorAnswer("gRPC", False, "no gRPC port yet"))
    return answers
