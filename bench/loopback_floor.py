"""The floor under any network front door: a raw TCP client and server on one cpu (no HTTP, no Python
parsing) exchanging a request of N bytes for a 4 KB answer, one at a time after random think times.
p50 round trip per request size; bench/RESULTS.md quotes it beside the front door's overhead.

    python -m bench.loopback_floor [--sizes 3000,602112] [--requests 200] [--cpu 0]
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time

ANSWER = 4096


def _serve(listener: socket.socket, size: int) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(size))
    while True:
        got = 0
        while got < size:
            n = conn.recv_into(view[got:], size - got)
            if not n:
                os._exit(0)
            got += n
        conn.sendall(b"y" * ANSWER)


def round_trip_p50_ms(size: int, requests: int, cpu: int) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, [cpu])
        _serve(listener, size)
    os.sched_setaffinity(0, [cpu])
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data, took = b"\0" * size, []
    try:
        for _ in range(requests):
            time.sleep(random.expovariate(1 / 0.02))
            t0 = time.perf_counter()
            client.sendall(data)
            got = 0
            while got < ANSWER:
                got += len(client.recv(1 << 16))
            took.append((time.perf_counter() - t0) * 1e3)
    finally:
        client.close()
        os.waitpid(pid, 0)
    return statistics.median(took)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="3000,602112", help="request sizes in bytes (ResNet-50's input: 602112)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--cpu", type=int, default=sorted(os.sched_getaffinity(0))[0])
    args = p.parse_args()
    for size in map(int, args.sizes.split(",")):
        print(f"{size} B request, {ANSWER} B answer, cpu {args.cpu}: p50 {round_trip_p50_ms(size, args.requests, args.cpu):.3f} ms")


if __name__ == "__main__":
    main()
