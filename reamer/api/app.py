"""The agent's HTTP API (FastAPI); served by the daemon on a Unix socket.

Every error is JSON {"error": {"code", "message", "fix"}} with a 4xx status for bad input; an
unexpected failure is a 500 with the same shape and no traceback (the agent log has it).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from reamer.agent.errors import AdmissionRefused, Conflict, InvalidRequest, NotFound
from reamer.api.schemas import (DemoteResult, ErrorBody, Event, EventList, GpuJobRequest, GpuJobUpdate, GpuStatus, Health,
                                InferenceJob, InferenceJobList, InferenceJobRequest, NodeInfo, TrainingJob,
                                TrainingJobList, TrainingJobRequest)
from reamer.host.errors import HostError, ReamerError

if TYPE_CHECKING:
    from reamer.agent.service import Agent

log = logging.getLogger("reamer.api")

MAX_WAIT_S = 60.0
ERRORS = {400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 409: {"model": ErrorBody}, 422: {"model": ErrorBody}}


def error_response(status: int, code: str, message: str, fix: str = "", data: dict | None = None) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "fix": fix, "data": data or {}}}
    return JSONResponse(status_code=status, content=body)


def _status_of(exc: ReamerError) -> tuple[int, str]:
    """HTTP status and error code for a user-facing error."""
    from reamer.agent.store import StoreError
    from reamer.agent.training import RtThrottlingDisabled
    from reamer.plan.coretable import AllocationError

    if isinstance(exc, NotFound):
        return 404, "not_found"
    if isinstance(exc, AdmissionRefused):
        return 409, "admission_refused"
    if isinstance(exc, Conflict):
        return 409, "conflict"
    if isinstance(exc, AllocationError):
        return 409, "insufficient_cores"
    if isinstance(exc, RtThrottlingDisabled):
        return 409, "rt_throttling_disabled"
    if isinstance(exc, StoreError):
        return 503, "store_unavailable"
    if isinstance(exc, InvalidRequest):
        return 400, "invalid_request"
    if type(exc).__name__ == "ContainerNotFound":
        return 404, "container_not_found"
    if isinstance(exc, HostError):
        return 400, "host_refused"
    return 400, "rejected"


def build_app(agent: "Agent") -> FastAPI:
    from reamer.agent.metrics import CONTENT_TYPE, AgentMetrics

    app = FastAPI(title="reamer agent API", version="1", description="Node agent: training pinning, CPU "
                  "inference co-location, GPU sharing. All errors: {\"error\": {\"code\", \"message\"}}.")
    metrics = AgentMetrics(agent)
    app.state.agent = agent
    app.state.metrics = metrics

    @app.exception_handler(ReamerError)
    async def _reamer_error(_: Request, exc: ReamerError) -> JSONResponse:
        status, code = _status_of(exc)
        data = exc.data if isinstance(exc, AdmissionRefused) else None
        message = exc.message + (f" — fix: {exc.fix}" if exc.fix else "")
        return error_response(status, code, message, exc.fix, data)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return error_response(422, "invalid_request", "invalid request: " + "; ".join(problems),
                              "fix the listed fields; see GET /openapi.json for the schema")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        fix = "see GET /openapi.json for the routes" if exc.status_code in (404, 405) else ""
        return error_response(exc.status_code, code, str(exc.detail), fix)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in an API call")
        return error_response(500, "internal", f"internal error ({type(exc).__name__}: {exc})",
                              "see the agent log (journalctl -u reamer) and report it")

    # --- node ---

    @app.get("/healthz", response_model=Health)
    def healthz() -> JSONResponse:
        ok, detail = agent.health()
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ok" if ok else "degraded", "detail": detail})

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/node", response_model=NodeInfo)
    def node() -> dict:
        return agent.node_info()

    # --- training ---

    @app.get("/v1/training-jobs", response_model=TrainingJobList)
    def list_training() -> dict:
        return {"jobs": agent.list_training()}

    @app.post("/v1/training-jobs", response_model=TrainingJob, status_code=201, responses=ERRORS)
    def attach_training(body: TrainingJobRequest) -> dict:
        return agent.attach_training(body.model_dump())

    @app.get("/v1/training-jobs/{name}", response_model=TrainingJob, responses=ERRORS)
    def get_training(name: str) -> dict:
        return agent.get_training(name)

    @app.delete("/v1/training-jobs/{name}", response_model=TrainingJob, responses=ERRORS)
    def detach_training(name: str) -> dict:
        return agent.detach_training(name)

    @app.post("/v1/demote-all", response_model=DemoteResult)
    def demote_all() -> dict:
        return agent.demote_all()

    # --- inference ---

    @app.get("/v1/inference-jobs", response_model=InferenceJobList)
    def list_inference() -> dict:
        return {"jobs": agent.list_inference()}

    @app.post("/v1/inference-jobs", response_model=InferenceJob, status_code=201, responses=ERRORS)
    def deploy_inference(body: InferenceJobRequest) -> dict:
        return agent.deploy_inference(body.model_dump())

    @app.get("/v1/inference-jobs/{name}", response_model=InferenceJob, responses=ERRORS)
    def get_inference(name: str) -> dict:
        return agent.get_inference(name)

    @app.delete("/v1/inference-jobs/{name}", response_model=InferenceJob, responses=ERRORS)
    def remove_inference(name: str) -> dict:
        return agent.remove_inference(name)

    # --- events ---

    @app.get("/v1/events", response_model=EventList)
    def events(since: int = Query(0, ge=0, description="return events with id > since"),
               wait: float = Query(0.0, ge=0, le=MAX_WAIT_S, description="long-poll up to this many seconds")) -> dict:
        found, last_id = agent.events_since(since, wait)
        return {"events": [Event(id=e.id, ts=e.ts, kind=e.kind, job=e.job, message=e.message, data=e.data)
                           for e in found], "last_id": last_id}

    # --- gpu ---
    # Job views carry desired / applied / limits_state / pending_restart (MPS applies limits only to
    # clients started afterwards) and `env`, the environment to launch the job with.

    @app.get("/v1/gpus", response_model=GpuStatus)
    def gpus() -> dict:
        return agent.gpu_status()

    @app.get("/v1/gpus/telemetry", responses=ERRORS)
    def gpu_telemetry(gpu: Optional[str] = Query(None, description="GPU index or UUID; all GPUs if absent")):
        return _gpu_call(agent.gpu_telemetry, gpu)

    @app.get("/v1/gpu-jobs")
    def list_gpu_jobs():
        return {"jobs": agent.gpu_jobs()}

    @app.post("/v1/gpu-jobs", status_code=201, responses=ERRORS)
    def register_gpu_job(body: GpuJobRequest):
        return _gpu_call(agent.gpu_register, body.model_dump(exclude_none=True))

    @app.get("/v1/gpu-jobs/{name}", responses=ERRORS)
    def get_gpu_job(name: str):
        return _gpu_call(agent.gpu_job, name)

    @app.patch("/v1/gpu-jobs/{name}", responses=ERRORS)
    def update_gpu_job(name: str, body: GpuJobUpdate):
        return _gpu_call(agent.gpu_update, name, body.model_dump(exclude_none=True))

    @app.delete("/v1/gpu-jobs/{name}", responses=ERRORS)
    def remove_gpu_job(name: str):
        return _gpu_call(agent.gpu_remove, name)

    return app


def _gpu_status_of(exc: Exception) -> tuple[int, str] | None:
    """HTTP status and code of a GPU-layer error (None: not one)."""
    from reamer.gpu import errors

    for cls, status, code in ((errors.UnknownJob, 404, "not_found"), (errors.UnknownGpu, 404, "unknown_gpu"),
                              (errors.NoGpuDriver, 409, "gpu_unavailable"), (errors.LimitError, 409, "gpu_limits"),
                              (errors.MpsError, 503, "mps_unavailable"), (errors.GpuError, 409, "gpu_refused")):
        if isinstance(exc, cls):
            return status, code
    return None


def _gpu_call(method, *args):
    """Call an Agent GPU method; GPU-layer errors become JSON errors with a GPU-specific status and code."""
    try:
        return method(*args)
    except ReamerError as exc:
        mapped = _gpu_status_of(exc)
        if mapped is None:
            raise  # the app's ReamerError handler maps it
        return error_response(mapped[0], mapped[1], exc.message + (f" — fix: {exc.fix}" if exc.fix else ""), exc.fix)
