"""The deploy check: a job's model and traffic (shapes, input_data), opened and checked before the job is made,
in a child process that has the rights of the user the job runs as.

Everything here is what that user can write: an ONNX file is a protobuf a parser must walk, a 1.5 MB
`.npz` can decompress to gigabytes, a JSON file can nest without end. So the agent (root) parses none of
it. It starts `python -I -m reamer.serve.deploy_check REQUEST` with the job user's uid, gid and groups,
from cwd "/", with a minimal environment, a data-segment limit (the job's memory limit) set before Python
starts, and a wall-clock timeout; the child answers one JSON line on stdout, which the agent reads up to
ANSWER_CAP bytes. The agent's lock is not held meanwhile, so every other caller is answered.

The child opens the model (its inputs read with onnx; the backend asked for opens it), checks the shapes
against it and reads the sample data, with the same problem + fix texts as `reamer.serve.samples` and
`reamer.serve.model_check` give in-process. A `.npz` whose arrays declare more bytes than the limit is
refused from their headers, before anything is decompressed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from reamer.host.access import Identity, as_user_kwargs, child_env, limited_argv

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MEMORY_MB = 4096.0
ANSWER_CAP = 64 * 1024  # bytes of the child's stdout the agent reads
TEXT_CAP = 2000  # characters of a message, a fix, or the child's last words kept
FILE_CAP = 1 << 20  # bytes the child may write to any file (its stdout and stderr are files)
MIB = 1 << 20
# how a process out of its data limit dies without a Python MemoryError (the loader, a runtime's allocator)
_OUT_OF_MEMORY = re.compile(r"MemoryError|bad_alloc|cannot map|cannot allocate memory|memory allocation", re.I)


@dataclass(frozen=True)
class DeployRequest:
    """What to check: the model, the backend to open it with (None: only its inputs against the traffic),
    and the traffic (perf_analyzer's --shape and --input-data)."""

    model: str
    backend: str | None = None
    shapes: dict[str, list[int]] = field(default_factory=dict)
    input_data: str | None = None

    def to_doc(self) -> dict[str, Any]:
        return {"model": self.model, "backend": self.backend, "shapes": self.shapes, "input_data": self.input_data}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "DeployRequest":
        return cls(str(doc["model"]), doc.get("backend"), dict(doc.get("shapes") or {}), doc.get("input_data"))

    def subject(self, stage: str) -> str:
        if stage == "input_data" and self.input_data:
            return f"input_data {self.input_data}"
        if stage == "both" and self.input_data:
            return f"model {self.model} with input_data {self.input_data}"
        return f"model {self.model}"


@dataclass(frozen=True)
class CheckProblem:
    message: str
    fix: str


@dataclass(frozen=True)
class DeployAnswer:
    """The check's verdict: problem None when the model and traffic are fine."""

    problem: CheckProblem | None
    exceeded: str = ""  # "memory" | "time" when a limit stopped the check
    inputs: list[dict[str, Any]] = field(default_factory=list)  # the model's inputs, when they were read


@dataclass(frozen=True)
class DeployCheck:
    """Whom the check runs as (None: this process's own user) and within what."""

    runner: Identity | None = None
    memory_mb: float = DEFAULT_MEMORY_MB
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_source: str = "inference.check_memory_mb"  # the setting that gives memory_mb (named in fixes)

    def run(self, request: DeployRequest) -> DeployAnswer:
        memory_bytes = int(self.memory_mb * MIB)
        argv = limited_argv([sys.executable, "-I", "-m", "reamer.serve.deploy_check",
                             json.dumps({"request": request.to_doc(), "memory_bytes": memory_bytes})],
                            memory_bytes, FILE_CAP)
        who = str(self.runner) if self.runner is not None else f"uid {os.geteuid()}"
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd="/",
                                        env=child_env(OMP_NUM_THREADS="1"), start_new_session=True,
                                        close_fds=True, **as_user_kwargs(self.runner))
            except OSError as exc:
                return DeployAnswer(_cannot_start(who, f"{exc.strerror} ({exc.filename or argv[0]})"))
            try:
                code = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill(proc)
                return DeployAnswer(self._took_too_long(request), exceeded="time")
            out.seek(0)
            answer = _last_json_line(out.read(ANSWER_CAP))
            err.seek(0, os.SEEK_END)
            err.seek(max(0, err.tell() - 4 * TEXT_CAP))
            last_words = _last_line(err.read())
        if answer is None:
            return self._no_answer(request, code, last_words, who)
        return self._read(request, answer)

    def _read(self, request: DeployRequest, answer: dict[str, Any]) -> DeployAnswer:
        inputs = answer.get("inputs") if isinstance(answer.get("inputs"), list) else []
        if answer.get("ok") is True:
            return DeployAnswer(None, inputs=inputs[:256])
        if answer.get("exceeded") == "memory":
            stage = str(answer.get("stage", "model"))
            declared = answer.get("declared_bytes")
            also = (f" (its arrays take {int(declared) / MIB:,.0f} MiB decompressed)"
                    if isinstance(declared, int) and declared > 0 else "")
            return DeployAnswer(CheckProblem(
                f"{request.subject(stage)} needs more than {self.memory_mb:g} MiB to check{also}, the memory limit "
                "the job would run with",
                ("give smaller sample data (a few rows per input are enough to shape the traffic), or "
                 if stage != "model" else "check that the model is the file you meant, or ")
                + f"raise {self.memory_source} (now {self.memory_mb:g} MiB)"), exceeded="memory")
        message, fix = answer.get("message"), answer.get("fix")
        if not isinstance(message, str) or not message:
            message = f"{request.subject('model')} could not be checked"
        if not isinstance(fix, str) or not fix:
            fix = "check the model file and the sample data"
        return DeployAnswer(CheckProblem(message[:TEXT_CAP], fix[:TEXT_CAP]), inputs=inputs[:256])

    def _took_too_long(self, request: DeployRequest) -> CheckProblem:
        what = f"model {request.model}" + (f" and input_data {request.input_data}" if request.input_data else "")
        return CheckProblem(f"checking {what} took longer than {self.timeout_s:g} s",
                            "give smaller sample data or a model that opens faster, or raise "
                            f"inference.check_timeout_s in the agent's config (now {self.timeout_s:g} s)")

    def _no_answer(self, request: DeployRequest, code: int, last_words: str, who: str) -> DeployAnswer:
        if "failed to execute" in last_words or (code == 126 and not last_words):
            return DeployAnswer(_cannot_start(who, last_words or f"exit code {code}"))
        if _OUT_OF_MEMORY.search(last_words):  # a runtime or the loader gave up on an allocation
            return self._read(request, {"exceeded": "memory", "stage": "both" if request.input_data else "model"})
        why = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
            else f"exit code {code}"
        what = f"model {request.model}" + (f" with input_data {request.input_data}" if request.input_data else "")
        return DeployAnswer(CheckProblem(
            f"checking {what} stopped without an answer ({why}{': ' + last_words if last_words else ''})",
            "check that the model is a file the backend opens (ONNX, or OpenVINO IR) and that input_data is a "
            f".npz or perf_analyzer JSON; if they are large, raise {self.memory_source} (now {self.memory_mb:g} "
            "MiB)"))


def _cannot_start(who: str, why: str) -> CheckProblem:
    return CheckProblem(f"the deploy check cannot start as {who}, who cannot read or execute reamer's python "
                        f"{sys.executable}: {why[:TEXT_CAP]}",
                        "install reamer where every job user can read and execute it (a system-wide install), "
                        "or deploy as another user")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: anything it started goes too
    except OSError:
        proc.kill()
    proc.wait()


def _last_line(raw: bytes) -> str:
    lines = [line.strip() for line in raw.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:TEXT_CAP] if lines else ""


def _last_json_line(raw: bytes) -> dict[str, Any] | None:
    line = _last_line(raw) if len(raw) < ANSWER_CAP else ""
    try:
        answer = json.loads(line) if line else None
    except (ValueError, RecursionError):
        return None
    return answer if isinstance(answer, dict) else None


# --------------------------------------------------------------------------- the child

def _check(request: DeployRequest, memory_bytes: int, stage: list[str]) -> dict[str, Any]:
    from reamer.serve.model_check import open_problem
    from reamer.serve.samples import SampleSpec, model_inputs, npz_declared_bytes, plan_samples

    answer: dict[str, Any] = {"ok": True}
    spec = SampleSpec(shapes=request.shapes, input_data=request.input_data)
    if not spec.is_default and request.model.endswith(".onnx"):
        inputs = model_inputs(request.model)
        answer["inputs"] = [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in inputs]
        if spec.input_data:
            stage[0] = "input_data"
            if spec.input_data.endswith(".npz"):
                declared = npz_declared_bytes(spec.input_data)
                if declared > memory_bytes:
                    return {"ok": False, "exceeded": "memory", "stage": "input_data", "declared_bytes": declared}
        plan_samples(inputs, spec, request.model)
    if request.backend:
        stage[0] = "model"
        problem = open_problem(request.backend, request.model)
        if problem is not None:
            return {"ok": False, "message": problem.message, "fix": problem.fix}
    else:  # backend "auto": what no backend could serve (a ZipMap output, a tensor without a v2 datatype)
        from reamer.serve.model_types import graph_problem

        stage[0] = "model"
        problem = graph_problem(request.model, None)
        if problem is not None:
            return {"ok": False, "message": problem.message, "fix": problem.fix}
    return answer


def main(argv: list[str]) -> int:
    from reamer.host.access import set_own_limits
    from reamer.host.errors import ReamerError

    doc = json.loads(argv[0])
    memory_bytes = int(doc["memory_bytes"])
    set_own_limits(memory_bytes, FILE_CAP)  # prlimit set them already where it is installed
    request = DeployRequest.from_doc(doc["request"])
    stage = ["model"]
    try:
        answer = _check(request, memory_bytes, stage)
    except MemoryError:
        answer = {"ok": False, "exceeded": "memory", "stage": stage[0]}
    except ReamerError as exc:
        answer = {"ok": False, "message": exc.message, "fix": exc.fix}
    except RecursionError:
        answer = {"ok": False, "message": f"{request.subject(stage[0])} is nested too deeply to read",
                  "fix": "give a flat perf_analyzer JSON or a .npz of named arrays" if stage[0] == "input_data"
                  else "check that the model is a valid ONNX file"}
    except Exception as exc:  # noqa: BLE001 - any parser's refusal of the user's file is the answer
        answer = {"ok": False, "message": f"{request.subject(stage[0])} cannot be read: {type(exc).__name__}: "
                                          f"{' '.join(str(exc).split())[:TEXT_CAP]}",
                  "fix": "give a .npz of named arrays or a perf_analyzer JSON input-data file"
                  if stage[0] == "input_data" else "check that it is an ONNX file"}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
