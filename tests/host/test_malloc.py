"""glibc malloc tuning of the job process."""
import subprocess
import sys

# In a fresh interpreter: receive a 600 KB body in three chunks and join them, as the front door does,
# many times over, and count the minor page faults of the second half.
_CHURN = r"""
import resource, sys
from reamer.host.malloc import keep_large_buffers
if sys.argv[1] == "tuned":
    assert keep_large_buffers()
def churn():
    for _ in range(100):
        chunks = [bytes(bytearray(b"x") * (200 * 1024)) for _ in range(3)]
        body = b"".join(chunks)
        del chunks, body
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_large_buffers_reuse_heap_memory_instead_of_faulting_fresh_pages():
    faults = {mode: int(subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("default", "tuned")}
    pages_per_round = (3 * 200 + 600) * 1024 // 4096
    assert faults["tuned"] < 100 * pages_per_round // 20, faults  # under 5 % of the pages touched
    assert faults["tuned"] <= faults["default"], faults
