"""Can this backend load this model? Asked before a job is made, so a deploy that could only fail later is
refused at once with the runtime's own reason (an operator OpenVINO has no conversion for, a file ONNX
Runtime rejects).

`open_problem` opens the model in the calling process; the agent never calls it itself: it runs in the
deploy check (reamer.serve.deploy_check), a child process with the job user's rights and memory limit.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

CHECK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LoadProblem:
    message: str
    fix: str


def open_problem(backend: str, model_path: str) -> LoadProblem | None:
    """None when `backend` opens `model_path` here; else the runtime's reason and what to do."""
    from reamer.serve.backends import BackendError, UnservableModel, open_backend
    from reamer.serve.model_types import graph_problem

    # inputs and outputs that are not tensors, element types without a v2 datatype, strings or custom ops
    # on OpenVINO: read from the graph before any runtime opens it, each with its exact fix
    problem = graph_problem(model_path, backend)
    if problem is not None:
        return LoadProblem(problem.message, problem.fix)
    try:
        with open_backend(backend, model_path, 1):
            pass
    except UnservableModel as error:  # its fix is exact: another backend would not serve it either
        return LoadProblem(error.message, error.fix)
    except BackendError as error:
        other = "onnxruntime" if backend == "openvino" else "openvino"
        return LoadProblem(error.message, f"deploy it with backend {other} (--backend {other}), or export the "
                                          f"model with operators {backend} supports")
    return None


def load_problem(backend: str, model_path: str, timeout_s: float = CHECK_TIMEOUT_S) -> LoadProblem | None:
    """open_problem in a child process (this process's user, the deploy check's default memory limit).

    A check that cannot finish is no evidence against the model: None."""
    from reamer.serve.deploy_check import DeployCheck, DeployRequest

    answer = DeployCheck(runner=None, timeout_s=timeout_s).run(DeployRequest(model_path, backend))
    if answer.problem is None or answer.exceeded:
        return None
    return LoadProblem(answer.problem.message, answer.problem.fix)


def main(argv: list[str]) -> int:
    backend, model_path = argv
    problem = open_problem(backend, model_path)
    print(json.dumps({"ok": True} if problem is None else
                     {"ok": False, "message": problem.message, "fix": problem.fix}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
