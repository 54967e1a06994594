import os
from pathlib import Path


def test_pid1_is_systemd():
    assert Path("/proc/1/comm").read_text().strip() == "systemd"
    assert os.environ["REAMER_LAB_PROFILE"]
