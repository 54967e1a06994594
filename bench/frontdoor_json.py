"""The front door's JSON path, before and after: decode of a tritonclient JSON infer request and encode of
its JSON answer, per request, in this process on one cpu (no model run: only what the front door does).

    python -m bench.frontdoor_json [--before REV] [--rounds 15] [--cpu N]
    python -m bench.frontdoor_json --e2e [--requests 20] [--rounds 3]   # tritonclient JSON, ResNet-50

--e2e serves ResNet-50 (one 1-thread instance on the last cpu, the front door on the first) with each
front door in turn, and times tritonclient JSON requests at concurrency 1 from the first cpu: p50 latency.

REV is the commit whose reamer/serve/doors/rest.py is "before" (default a32fa24, the last one with the
standard library's json). Rounds alternate before/after so a noisy, shared machine affects both alike;
figures are medians per request, and the ratio before / after.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.http as triton

from bench.harness import ROOT as REPO

from reamer.serve.protocol import rest_codec as after
from reamer.serve.protocol.tensors import TensorInfo


def door_source(rev: str) -> str:
    """The REST front door's source at `rev` (reamer/serve/frontdoor.py before the serve/ split)."""
    for path in ("reamer/serve/doors/rest.py", "reamer/serve/frontdoor.py"):
        found = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True)
        if found.returncode == 0:
            return found.stdout
    raise SystemExit(f"no REST front door at {rev}: give --before a commit of this repository")


# Where the names an older front door imports live now (serve/ was split by purpose after a32fa24): each old
# module path answers from the first of its successors that has the name.
MOVED_SERVE_MODULES = {
    "reamer.serve.batcher": ("reamer.serve.runtime.batcher",),
    "reamer.serve.tensors": ("reamer.serve.protocol.tensors",),
    "reamer.serve.v2wire": ("reamer.serve.protocol.v2wire", "reamer.serve.doors.http_framing"),
    "reamer.serve.worker": ("reamer.serve.runtime.instances", "reamer.serve.runtime.worker",
                            "reamer.serve.runtime.instance_worker"),
}


def alias_moved_modules() -> None:
    """Let an older front door's `from reamer.serve.X import ...` find the names where they are now."""
    import types

    for old, successors in MOVED_SERVE_MODULES.items():
        if importlib.util.find_spec(old.rpartition(".")[0]) is None or old in sys.modules:
            continue
        try:
            if importlib.util.find_spec(old) is not None:
                continue  # still there: nothing moved
        except ModuleNotFoundError:
            pass
        alias = types.ModuleType(old)

        def lookup(name: str, successors: tuple[str, ...] = successors, old: str = old) -> object:
            for new in successors:
                try:
                    module = importlib.import_module(new)
                except ModuleNotFoundError:
                    continue
                if hasattr(module, name):
                    return getattr(module, name)
            raise AttributeError(f"{old}.{name} is in none of {', '.join(successors)}")

        alias.__getattr__ = lookup  # type: ignore[method-assign]
        sys.modules[old] = alias


def load_before(rev: str):
    alias_moved_modules()
    source = door_source(rev)
    path = Path(tempfile.mkdtemp()) / "frontdoor_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("frontdoor_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["frontdoor_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def case(name, inputs: dict[str, tuple[str, np.ndarray]], outputs: dict[str, tuple[str, np.ndarray]]):
    """A tritonclient JSON request body for `inputs` and the model outputs to answer it with."""
    ins = []
    for n, (dt, a) in inputs.items():
        i = triton.InferInput(n, list(a.shape), dt)
        i.set_data_from_numpy(a, binary_data=False)
        ins.append(i)
    outs = [triton.InferRequestedOutput(n, binary_data=False) for n in outputs]
    body, json_size = triton.InferenceServerClient.generate_request_body(ins, outs)
    assert json_size is None
    model_in = [TensorInfo(n, dt, [-1, *a.shape[1:]]) for n, (dt, a) in inputs.items()]
    model_out = [TensorInfo(n, dt, [-1, *a.shape[1:]]) for n, (dt, a) in outputs.items()]
    return name, body, model_in, model_out, {n: a for n, (_, a) in outputs.items()}


def per_request(module, body, model_in, model_out, results, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        decoded = module.decode_request(body, None, model_in, model_out)
        content, _ = module.encode_response("m", decoded, results, model_out)
    return (time.perf_counter() - start) / reps


SERVER = """
import asyncio, importlib.util, os, sys, uvloop
os.sched_setaffinity(0, [{door_cpu}])
from reamer.serve.runtime.batcher import DynamicBatcher
from reamer.serve.spec import InstanceSpec
from reamer.serve.runtime.instances import InstanceWorker
from bench.frontdoor_json import alias_moved_modules
alias_moved_modules()
spec = importlib.util.spec_from_file_location("door", {module!r})
door_module = importlib.util.module_from_spec(spec); sys.modules["door"] = door_module; spec.loader.exec_module(door_module)

async def main():
    worker = InstanceWorker(0, InstanceSpec([{instance_cpu}], 1, 1), {model!r}, run_dir={run_dir!r})
    await asyncio.get_running_loop().run_in_executor(None, worker.start)
    batcher = DynamicBatcher(None, name="m")
    batcher.add_instance(worker)
    door = getattr(door_module, "FrontDoor", None) or importlib.import_module("reamer.serve.doors.http_server").FrontDoor
    door = door(door_module.V2App("m", batcher), "127.0.0.1", 0)
    print(door.port, flush=True)
    await door.serve()

uvloop.run(main())
"""


def e2e(args) -> None:
    from reamer.serve.models import build_model

    cpus = sorted(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp())
    model = build_model("resnet50", work / "resnet50.onnx").path
    before_path = work / "frontdoor_before.py"
    before_path.write_text(door_source(args.before))
    variants = {"before": str(before_path), "after": str(REPO / "reamer/serve/doors/rest.py")}
    os.sched_setaffinity(0, [cpus[0]])
    image = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    p50s: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, module in variants.items():
            code = SERVER.format(door_cpu=cpus[0], instance_cpu=cpus[-1], module=module,
                                 model=str(model), run_dir=str(work))
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
            try:
                port = int(proc.stdout.readline())
                client = triton.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
                while not client.is_server_ready():
                    time.sleep(0.2)
                inp = triton.InferInput("input", [1, 3, 224, 224], "FP32")
                inp.set_data_from_numpy(image, binary_data=False)
                out = [triton.InferRequestedOutput("logits", binary_data=False)]
                for _ in range(3):
                    client.infer("m", [inp], outputs=out)  # warm-up
                times = []
                for _ in range(args.requests):
                    start = time.perf_counter()
                    client.infer("m", [inp], outputs=out)
                    times.append(time.perf_counter() - start)
                p50s[name].append(statistics.median(times))
                client.close()
            finally:
                proc.terminate()
                proc.wait(30)
    b, a = statistics.median(p50s["before"]), statistics.median(p50s["after"])
    print(f"ResNet-50, tritonclient JSON in and out, concurrency 1, {args.requests} requests x {args.rounds} rounds: "
          f"p50 before {b * 1e3:.1f} ms, after {a * 1e3:.1f} ms, before/after {b / a:.2f}x "
          f"(rounds: before {[round(x * 1e3, 1) for x in p50s['before']]}, after {[round(x * 1e3, 1) for x in p50s['after']]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="a32fa24")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cpu", type=int, default=sorted(os.sched_getaffinity(0))[-1])
    parser.add_argument("--e2e", action="store_true", help="tritonclient JSON against a served ResNet-50")
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    if args.e2e:
        e2e(args)
        return
    os.sched_setaffinity(0, [args.cpu])
    before = load_before(args.before)
    rng = np.random.default_rng(0)
    cases = [
        case("ResNet-50 (1x3x224x224 FP32 in, 1x1000 out)",
             {"input": ("FP32", rng.standard_normal((1, 3, 224, 224)).astype(np.float32))},
             {"output": ("FP32", rng.standard_normal((1, 1000)).astype(np.float32))}),
        case("BERT-base (2x 1x128 INT64 in, 1x128x768 + 1x768 FP32 out)",
             {"input_ids": ("INT64", rng.integers(0, 30000, (1, 128))),
              "attention_mask": ("INT64", np.ones((1, 128), np.int64))},
             {"last_hidden_state": ("FP32", rng.standard_normal((1, 128, 768)).astype(np.float32)),
              "pooler_output": ("FP32", rng.standard_normal((1, 768)).astype(np.float32))}),
        case("small (1x8 FP32 + 1x4 INT64 in, 1x4 out)",
             {"x": ("FP32", rng.standard_normal((1, 8)).astype(np.float32)), "ids": ("INT64", rng.integers(0, 9, (1, 4)))},
             {"scores": ("FP32", rng.standard_normal((1, 4)).astype(np.float32))}),
    ]
    print(f"cpu {args.cpu}, {args.rounds} alternating rounds, medians per request (decode + encode)")
    for name, body, model_in, model_out, results in cases:
        # the answers must decode to the same tensors through tritonclient
        for module in (before, after):
            decoded = module.decode_request(body, None, model_in, model_out)
            content, _ = module.encode_response("m", decoded, results, model_out)
            got = triton.InferResult.from_response_body(content)
            for n, a in results.items():
                np.testing.assert_allclose(got.as_numpy(n), a, rtol=1e-6)
        once = per_request(after, body, model_in, model_out, results, 1)
        reps = max(1, int(0.2 / max(once, 1e-6)))
        times = {"before": [], "after": []}
        for _ in range(args.rounds):
            times["before"].append(per_request(before, body, model_in, model_out, results, reps))
            times["after"].append(per_request(after, body, model_in, model_out, results, reps))
        b, a = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"{name}: body {len(body) / 1024:.0f} KiB; before {b * 1e3:.3f} ms, after {a * 1e3:.3f} ms, "
              f"before/after {b / a:.2f}x")


if __name__ == "__main__":
    main()
