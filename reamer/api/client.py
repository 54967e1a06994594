"""A client of the agent's API over its Unix socket (httpx)."""
from __future__ import annotations

from typing import Any

import httpx
from pydantic import ValidationError

from reamer.api.schemas import (DemoteResult, EventList, GpuStatus, InferenceJob, InferenceJobList,
                                InferenceJobRequest, NodeInfo, TrainingJob, TrainingJobList, TrainingJobRequest)
from reamer.host.errors import ReamerError

DEFAULT_TIMEOUT_S = 30.0
FOLLOW_WAIT_S = 25.0


class AgentUnreachable(ReamerError):
    """Nothing answers on the agent's socket."""


class ApiError(ReamerError):
    """The agent answered with an error: `status` (HTTP), `code` and the agent's message and fix. Both are the
    agent's answer (its reamer.errors table, whatever its version), not this class's kind."""

    status: int = 0  # type: ignore[assignment]  # an answer's, where other errors read their kind's
    code: str = ""  # type: ignore[assignment]

    def __init__(self, status: int, code: str, message: str, fix: str = "", data: dict | None = None) -> None:
        super().__init__(message, fix)
        self.status = status
        self.code = code
        self.data = data or {}



def _unreachable(socket_path: str, why: str) -> AgentUnreachable:
    return AgentUnreachable(
        f"the reamer agent is not reachable on {socket_path} ({why})",
        "start it: systemctl start reamer / reamer daemon --config /etc/reamer/reamer.yaml; "
        "or pass --socket (env REAMER_SOCKET) or --instance NAME if it listens elsewhere")


class ApiClient:
    def __init__(self, socket_path: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self._http = httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://reamer",
                                  timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ApiClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- transport ---

    def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                timeout: float | None = None) -> Any:
        """One call; returns the decoded JSON body. Raises AgentUnreachable or ApiError."""
        kwargs: dict[str, Any] = {"json": json, "params": params}
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise AgentUnreachable(f"the reamer agent on {self.socket_path} did not answer {method} {path} in time",
                                   "check the agent log (journalctl -u reamer); it may be overloaded or stuck") from None
        except (httpx.TransportError, FileNotFoundError, ConnectionError) as exc:  # refused, reset, cut off mid-answer
            raise _unreachable(self.socket_path, str(exc) or type(exc).__name__) from None
        except PermissionError as exc:
            raise AgentUnreachable(f"not allowed to connect to {self.socket_path} ({exc})",
                                   "run as root or as a member of the socket's group") from None
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                message, fix = error.get("message", ""), error.get("fix", "")
                suffix = f" — fix: {fix}"
                if fix and message.endswith(suffix):  # the agent spells the fix out in the message too
                    message = message[: -len(suffix)]
                raise ApiError(response.status_code, error.get("code", "error"), message, fix,
                               error.get("data") or {})
            except (ValueError, KeyError, TypeError):
                raise ApiError(response.status_code, "http_error",
                               f"the agent answered {response.status_code}: {response.text[:200]}") from None
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    # --- node ---

    def health(self) -> dict:
        return self.request("GET", "/healthz")

    def node(self) -> NodeInfo:
        return NodeInfo.model_validate(self.request("GET", "/v1/node"))

    def metrics(self) -> str:
        return self.request("GET", "/metrics")

    def capacity(self) -> dict:
        """Spare capacity in the units schedulers count (GET /v1/capacity)."""
        return self.request("GET", "/v1/capacity")

    # --- training ---

    def list_training_jobs(self) -> list[TrainingJob]:
        return TrainingJobList.model_validate(self.request("GET", "/v1/training-jobs")).jobs

    def get_training_job(self, name: str) -> TrainingJob:
        return TrainingJob.model_validate(self.request("GET", f"/v1/training-jobs/{name}"))

    def attach_training(self, request: TrainingJobRequest | dict) -> TrainingJob:
        body = _body(request, TrainingJobRequest)
        return TrainingJob.model_validate(self.request("POST", "/v1/training-jobs", json=body))

    def detach_training(self, name: str) -> TrainingJob:
        return TrainingJob.model_validate(self.request("DELETE", f"/v1/training-jobs/{name}"))

    def demote_all(self) -> DemoteResult:
        return DemoteResult.model_validate(self.request("POST", "/v1/demote-all"))

    # --- inference ---

    def list_inference_jobs(self) -> list[InferenceJob]:
        return InferenceJobList.model_validate(self.request("GET", "/v1/inference-jobs")).jobs

    def get_inference_job(self, name: str) -> InferenceJob:
        return InferenceJob.model_validate(self.request("GET", f"/v1/inference-jobs/{name}"))

    def deploy_inference(self, request: InferenceJobRequest | dict) -> InferenceJob:
        body = _body(request, InferenceJobRequest)
        return InferenceJob.model_validate(self.request("POST", "/v1/inference-jobs", json=body,
                                                        timeout=max(DEFAULT_TIMEOUT_S, 120.0)))

    def remove_inference(self, name: str) -> InferenceJob:
        return InferenceJob.model_validate(self.request("DELETE", f"/v1/inference-jobs/{name}"))

    # --- events ---

    def events(self, since: int = 0, wait: float | bool = 0.0) -> EventList:
        """Events with id > since; wait=True (or seconds) long-polls until there is one."""
        wait_s = FOLLOW_WAIT_S if wait is True else float(wait or 0.0)
        data = self.request("GET", "/v1/events", params={"since": since, "wait": wait_s},
                            timeout=wait_s + DEFAULT_TIMEOUT_S)
        return EventList.model_validate(data)

    # --- gpu ---

    def gpus(self) -> GpuStatus:
        return GpuStatus.model_validate(self.request("GET", "/v1/gpus"))

    def register_gpu_job(self, request: dict) -> dict:
        return self.request("POST", "/v1/gpu-jobs", json=request)

    def remove_gpu_job(self, name: str) -> dict:
        return self.request("DELETE", f"/v1/gpu-jobs/{name}")


def _body(request: Any, model: type) -> dict:
    if isinstance(request, dict):
        try:
            request = model.model_validate(request)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())
            raise ApiError(422, "invalid_request", f"invalid request: {problems}",
                           "fix the listed fields (see `reamer --help` for the options)") from None
    return request.model_dump(mode="json", exclude_none=True)
