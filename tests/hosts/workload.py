"""Stand-in training process for the host lab (stdlib only, run with Debian's python3 in the VM).

argv[1] threads sleep in short steps (they never spin: SCHED_RR spinners would starve an emulated VM).
SIGUSR1: start one more thread. SIGUSR2: fork a child that starts a thread of its own."""
import os
import signal
import sys
import threading
import time


def sleeper() -> None:
    while True:
        time.sleep(0.2)


def start_thread() -> None:
    threading.Thread(target=sleeper, daemon=True).start()


def fork_child(*_: object) -> None:
    if os.fork() == 0:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        start_thread()
        while True:
            time.sleep(0.2)


for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    start_thread()
signal.signal(signal.SIGUSR1, lambda *_: start_thread())
signal.signal(signal.SIGUSR2, fork_child)
print("ready", flush=True)
while True:
    time.sleep(0.2)
