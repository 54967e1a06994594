"""Can this backend load this model? Asked before a job is made, so a deploy that could only fail later is
refused at once with the runtime's own reason (an operator OpenVINO has no conversion for, a file ONNX
Runtime rejects).

The model is opened in a child process (`python -m reamer.serve.model_check BACKEND MODEL`): the agent
never loads runtimes or model weights itself.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

CHECK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LoadProblem:
    message: str
    fix: str


def load_problem(backend: str, model_path: str, timeout_s: float = CHECK_TIMEOUT_S) -> LoadProblem | None:
    """None when `backend` opens `model_path`; else the runtime's reason and what to do.

    A check that cannot finish (timeout, the child killed) is no evidence against the model: None."""
    try:
        done = subprocess.run([sys.executable, "-m", "reamer.serve.model_check", backend, model_path],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    lines = done.stdout.strip().splitlines()
    if not lines:
        return None
    try:
        answer = json.loads(lines[-1])
    except ValueError:
        return None
    if answer.get("ok"):
        return None
    return LoadProblem(answer.get("message", "the model could not be opened"), answer.get("fix", ""))


def main(argv: list[str]) -> int:
    backend, model_path = argv
    from reamer.serve.backends import BackendError, open_backend

    try:
        with open_backend(backend, model_path, 1):
            pass
    except BackendError as error:
        other = "onnxruntime" if backend == "openvino" else "openvino"
        print(json.dumps({"ok": False, "message": error.message,
                          "fix": f"deploy it with backend {other} (--backend {other}), or export the model "
                                 f"with operators {backend} supports"}))
        return 0
    print(json.dumps({"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
