"""The agent's HTTP API (FastAPI); served by the daemon on a Unix socket.

Every error is JSON {"error": {"code", "message", "fix"}} with a 4xx status for bad input; an
unexpected failure is a 500 with the same shape and no traceback (the agent log has it).

Every request carries its caller (SO_PEERCRED, read by reamer.api.server) and every handler passes
it to the agent, whose policy (reamer.agent.policy) decides; a request that did not come over the
Unix socket is refused. Bodies are size-limited (413) and long-polls wait on the event loop, so
they never hold the worker threads other calls need.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from fastapi import Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from reamer.agent.policy import Caller
from reamer.api.server import PEER_SCOPE_KEY
from reamer.api.schemas import (Capacity as CapacitySchema, InferenceAdmission, InferenceAdmissionRequest,
                                 TrainingAdmission, TrainingAdmissionRequest, DemoteResult, ErrorBody, Event, EventList, GpuJobRequest, GpuJobUpdate, GpuStatus, Health,
                                InferenceJob, InferenceJobList, InferenceJobRequest, NodeInfo, TrainingJob,
                                TrainingJobList, TrainingJobRequest)
from reamer.errors import ErrorKind, ReamerError
from reamer.host.access import in_group

if TYPE_CHECKING:
    from reamer.agent.metrics import AgentMetrics
    from reamer.agent.service import Agent

log = logging.getLogger("reamer.api")

MAX_WAIT_S = 60.0
SQLITE_MAX_INT = 2**63 - 1
LONG_POLL_STEP_S = 0.2
# A body over the limit but within this many times it is read and dropped before the 413 (a client
# still sending when the server closes may see a reset instead of the answer); larger ones are cut off.
DRAIN_FACTOR = 4
# Every route may answer these: the caller is not allowed (403), the body is too large (413), a
# mistake in the request (422), a long-poll too many (429), the store failing (503).
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorBody, "description": "refused by the access policy (error.data.rule names the rule)"},
    413: {"model": ErrorBody, "description": "request body over security.max_body_kb"},
    422: {"model": ErrorBody, "description": "invalid request"},
    503: {"model": ErrorBody, "description": "the agent's store is unavailable"},
}
ERRORS = {400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 409: {"model": ErrorBody}, **COMMON_ERRORS}


def _error_body(code: str, message: str, fix: str = "", data: dict | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "fix": fix, "data": data or {}}}


def error_response(kind: ErrorKind, message: str, fix: str = "", data: dict | None = None,
                   headers: dict[str, str] | None = None, status: int | None = None) -> JSONResponse:
    """The JSON error of `kind` (its code and status from the one table, reamer.errors.ErrorKind); `status`
    only for an HTTP error whose status the framework chose."""
    return JSONResponse(status_code=status or kind.status, content=_error_body(kind.code, message, fix, data),
                        headers=headers)


async def _send_error(send: Any, kind: ErrorKind, message: str, fix: str) -> None:
    body = json.dumps(_error_body(kind.code, message, fix)).encode()
    await send({"type": "http.response.start", "status": kind.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class SocketGate:
    """ASGI middleware: only requests over the Unix socket (with peer credentials) get in, and their
    bodies are read up to `max_body` bytes before the app sees them (413 beyond it)."""

    def __init__(self, app: Any, max_body: int) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get(PEER_SCOPE_KEY) is None:
            await _send_error(send, ErrorKind.FORBIDDEN,
                              "refused by rule unix_socket_only: the agent answers only callers on its Unix "
                              "socket (it must know who calls)", "connect to the agent's socket "
                              "(reamer --socket PATH, or REAMER_SOCKET)")
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > DRAIN_FACTOR * self.max_body):
            await self._too_large(send)  # far too large: answer at once and close
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > DRAIN_FACTOR * self.max_body:
                await self._too_large(send)
                return
            if size <= self.max_body:
                chunks.append(chunk)
            if not message.get("more_body"):
                break
        if size > self.max_body:  # read (bounded) and dropped, so the client reliably gets the answer
            await self._too_large(send)
            return
        body = b"".join(chunks)
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Any) -> None:
        await _send_error(send, ErrorKind.BODY_TOO_LARGE,
                          f"the request body is larger than {self.max_body // 1024} KiB",
                          "send a smaller request (or raise security.max_body_kb in the agent's config)")


async def caller_of(request: Request) -> Caller:
    """The caller of this request (SocketGate let only requests with credentials in)."""
    peer = request.scope[PEER_SCOPE_KEY]
    admin_group = request.app.state.agent.config.security.admin_group
    return Caller(uid=peer.uid, gid=peer.gid, pid=peer.pid, admin=in_group(peer.uid, peer.gid, admin_group))


def build_app(agent: "Agent", metrics: "AgentMetrics | None" = None) -> FastAPI:
    """The API over `agent`; `metrics` is the agent's registry (the composition root builds it; made here if
    not given)."""
    from reamer.agent.metrics import CONTENT_TYPE, AgentMetrics

    app = FastAPI(title="reamer agent API", version="1", description="Node agent: training pinning, CPU "
                  "inference co-location, GPU sharing. All errors: {\"error\": {\"code\", \"message\"}}. "
                  "Only callers on the agent's Unix socket are served; who may do what: docs/security.md.",
                  responses=COMMON_ERRORS)
    metrics = metrics or AgentMetrics(agent)
    app.state.agent = agent
    app.state.metrics = metrics
    security = agent.config.security
    app.add_middleware(SocketGate, max_body=security.max_body_kb * 1024)
    long_polls = {"open": 0}

    @app.exception_handler(ReamerError)
    async def _reamer_error(_: Request, exc: ReamerError) -> JSONResponse:
        data = exc.data if exc.kind in (ErrorKind.ADMISSION_REFUSED, ErrorKind.FORBIDDEN) else None
        message = exc.message + (f" — fix: {exc.fix}" if exc.fix else "")
        return error_response(exc.kind, message, exc.fix, data)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return error_response(ErrorKind.INVALID_FIELDS, "invalid request: " + "; ".join(problems),
                              "fix the listed fields; see GET /openapi.json for the schema")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED}.get(exc.status_code, ErrorKind.HTTP_ERROR)
        fix = "see GET /openapi.json for the routes" if exc.status_code in (404, 405) else ""
        return error_response(kind, str(exc.detail), fix, headers=getattr(exc, "headers", None),
                              status=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in an API call")
        return error_response(ErrorKind.INTERNAL, f"internal error ({type(exc).__name__}: {exc})",
                              "see the agent log (journalctl -u reamer) and report it")

    # --- node ---

    @app.get("/healthz", response_model=Health, responses={503: {"model": Health}})
    def healthz() -> JSONResponse:
        ok, detail = agent.health()
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ok" if ok else "degraded", "detail": detail})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/node", response_model=NodeInfo)
    def node() -> dict:
        return agent.node_info()

    # --- for cluster schedulers: capacity and dry-run admission (nothing changes) ---

    @app.get("/v1/capacity", response_model=CapacitySchema)
    def capacity() -> dict:
        return agent.capacity()

    @app.post("/v1/admission/training", response_model=TrainingAdmission, responses=ERRORS)
    def admission_training(body: TrainingAdmissionRequest) -> dict:
        return agent.admit_training_dry(body.model_dump())

    @app.post("/v1/admission/inference", response_model=InferenceAdmission, responses=ERRORS)
    def admission_inference(body: InferenceAdmissionRequest) -> dict:
        return agent.admit_inference_dry(body.model_dump())

    # --- training ---

    @app.get("/v1/training-jobs", response_model=TrainingJobList)
    def list_training() -> dict:
        return {"jobs": agent.list_training()}

    @app.post("/v1/training-jobs", response_model=TrainingJob, status_code=201, responses=ERRORS)
    def attach_training(body: TrainingJobRequest, caller: Caller = Depends(caller_of)) -> dict:
        return agent.attach_training(body.model_dump(), caller)

    @app.get("/v1/training-jobs/{name}", response_model=TrainingJob, responses=ERRORS)
    def get_training(name: str) -> dict:
        return agent.get_training(name)

    @app.delete("/v1/training-jobs/{name}", response_model=TrainingJob, responses=ERRORS)
    def detach_training(name: str, caller: Caller = Depends(caller_of)) -> dict:
        return agent.detach_training(name, caller)

    # The big red button runs on threads of its own: however many slow calls hold the shared worker
    # threads (deploys waiting for a layout search, ...), it always answers.
    demote_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reamer-demote")

    @app.post("/v1/demote-all", response_model=DemoteResult, responses=ERRORS)
    async def demote_all(caller: Caller = Depends(caller_of)) -> Any:
        return await asyncio.get_running_loop().run_in_executor(demote_threads, agent.demote_all, caller)

    # --- inference ---

    @app.get("/v1/inference-jobs", response_model=InferenceJobList)
    def list_inference() -> dict:
        return {"jobs": agent.list_inference()}

    @app.post("/v1/inference-jobs", response_model=InferenceJob, status_code=201, responses=ERRORS)
    def deploy_inference(body: InferenceJobRequest, caller: Caller = Depends(caller_of)) -> dict:
        return agent.deploy_inference(body.model_dump(), caller)

    @app.get("/v1/inference-jobs/{name}", response_model=InferenceJob, responses=ERRORS)
    def get_inference(name: str) -> dict:
        return agent.get_inference(name)

    @app.delete("/v1/inference-jobs/{name}", response_model=InferenceJob, responses=ERRORS)
    def remove_inference(name: str, caller: Caller = Depends(caller_of)) -> dict:
        return agent.remove_inference(name, caller)

    # --- events ---

    @app.get("/v1/events", response_model=EventList,
             responses={429: {"model": ErrorBody, "description": "too many long-polls open"}})
    async def events(request: Request,
                     since: int = Query(0, ge=0, le=SQLITE_MAX_INT, description="return events with id > since"),
                     wait: float = Query(0.0, ge=0, le=MAX_WAIT_S, allow_inf_nan=False,
                                         description="long-poll up to this many seconds")) -> Any:
        # The wait happens here on the event loop (a sleep, no thread), so any number of long-polls
        # leaves the worker threads to the other calls; the open ones are capped all the same.
        if wait > 0 and agent.events.last_id <= since:
            if long_polls["open"] >= security.max_long_polls:
                return error_response(ErrorKind.TOO_MANY_LONG_POLLS,
                                      f"{long_polls['open']} long-polls are open already (security.max_long_polls)",
                                      "retry later, or poll without wait")
            long_polls["open"] += 1
            try:
                deadline = time.monotonic() + wait
                while agent.events.last_id <= since and time.monotonic() < deadline:
                    await asyncio.sleep(min(LONG_POLL_STEP_S, max(0.0, deadline - time.monotonic())))
                    if await request.is_disconnected():  # else an abandoned long-poll keeps its place for `wait`
                        return Response(status_code=499)
            finally:
                long_polls["open"] -= 1
        found, last_id = await run_in_threadpool(agent.events_since, since, 0.0)
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
        return agent.gpu_telemetry(gpu)

    @app.get("/v1/gpu-jobs")
    def list_gpu_jobs():
        return {"jobs": agent.gpu_jobs()}

    @app.post("/v1/gpu-jobs", status_code=201, responses=ERRORS)
    def register_gpu_job(body: GpuJobRequest, caller: Caller = Depends(caller_of)):
        return agent.gpu_register(body.model_dump(exclude_none=True), caller)

    @app.get("/v1/gpu-jobs/{name}", responses=ERRORS)
    def get_gpu_job(name: str):
        return agent.gpu_job(name)

    @app.patch("/v1/gpu-jobs/{name}", responses=ERRORS)
    def update_gpu_job(name: str, body: GpuJobUpdate, caller: Caller = Depends(caller_of)):
        return agent.gpu_update(name, body.model_dump(exclude_none=True), caller)

    @app.delete("/v1/gpu-jobs/{name}", responses=ERRORS)
    def remove_gpu_job(name: str, caller: Caller = Depends(caller_of)):
        return agent.gpu_remove(name, caller)

    return app
