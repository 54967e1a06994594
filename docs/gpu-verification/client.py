"""A real CUDA client for the MPS probes.

usage: client.py RESULT_FILE [--alloc MAX_MB] [--hold STOP_FILE] [--matmul N] [--fault]
Writes one JSON line (RESULT) to RESULT_FILE; with --hold, appends "READY" and then keeps doing small
GPU work every 0.2 s until STOP_FILE exists, appending any error it hits (one JSON line each).
"""
import json
import os
import sys
import time


def main():
    res_path = sys.argv[1]
    args = sys.argv[2:]
    alloc = int(args[args.index("--alloc") + 1]) if "--alloc" in args else 0
    hold = args[args.index("--hold") + 1] if "--hold" in args else None
    matmul = int(args[args.index("--matmul") + 1]) if "--matmul" in args else 0
    if "--ignore-term" in args:
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = {"pid": os.getpid(), "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS")}}
    t0 = time.monotonic()

    def emit(d):
        with open(res_path, "a") as fh:
            fh.write(json.dumps(d) + "\n")

    if "--fault" in args:
        try:
            import cupy as cp
            k = cp.RawKernel(r'''extern "C" __global__ void bad(int* p){ p[threadIdx.x + (1LL<<38)] = 1; }''', "bad")
            x = cp.zeros(1, dtype=cp.int32)
            cp.cuda.runtime.deviceSynchronize()
            out["before_fault_s"] = time.monotonic() - t0
            k((1,), (32,), (x,))
            cp.cuda.runtime.deviceSynchronize()
            out["fault"] = "no fault"
        except Exception as exc:  # noqa: BLE001
            out["fault"] = repr(exc)[:600]
        emit(out)
        return
    try:
        import torch
        torch.cuda.init()
        out["device_count"] = torch.cuda.device_count()
        p = torch.cuda.get_device_properties(0)
        out.update(name=p.name, sms=p.multi_processor_count, total_mb=round(p.total_memory / 2**20),
                   uuid=str(getattr(p, "uuid", "")))
        free, total = torch.cuda.mem_get_info()
        out.update(free_mb=round(free / 2**20), info_total_mb=round(total / 2**20))
        out["init_s"] = round(time.monotonic() - t0, 2)
        if matmul:
            a = torch.randn(matmul, matmul, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(matmul, matmul, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                c = a @ b
            torch.cuda.synchronize()
            n = 30
            t = time.perf_counter()
            for _ in range(n):
                c = a @ b
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            out["tflops"] = round(n * 2 * matmul**3 / dt / 1e12, 1)
            del a, b, c
            torch.cuda.empty_cache()
        if alloc:
            chunks = []
            step = 128
            got = 0
            try:
                while got + step <= alloc:
                    chunks.append(torch.empty(step * 2**20, dtype=torch.uint8, device="cuda"))
                    got += step
                out["alloc_ok_mb"] = got
            except Exception as exc:  # noqa: BLE001
                out["alloc_ok_mb"] = got
                out["alloc_error"] = str(exc).splitlines()[0][:300]
            del chunks
            torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001
        out["error"] = repr(exc)[:600]
    emit(out)
    if hold and "error" not in out:
        x = torch.zeros(1024, device="cuda")
        emit({"ready": True})
        errors = 0
        while not os.path.exists(hold):
            try:
                x += 1
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                errors += 1
                if errors <= 3:
                    emit({"hold_error": repr(exc)[:400], "t": round(time.monotonic() - t0, 2)})
            time.sleep(0.2)
        emit({"stopped": True, "errors": errors})


if __name__ == "__main__":
    main()
