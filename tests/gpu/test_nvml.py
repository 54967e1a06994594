"""NVML telemetry against the fake pynvml module, and the real module's no-driver behaviour here."""
from __future__ import annotations

import pytest

from reamer.gpu.errors import NoGpuDriver, UnknownGpu
from reamer.gpu.nvml import Nvml
from tests.gpu.fakes.fake_pynvml import NVML_ERROR_LIBRARY_NOT_FOUND, FakeGpu, FakeNvml

U0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
U1 = "GPU-bbbbbbbb-0000-0000-0000-000000000001"


@pytest.fixture
def fake():
    return FakeNvml([FakeGpu(U0, memory_total_mb=1000), FakeGpu(U1, xid_supported=False, power_supported=False)])


def test_inventory_and_resolve(fake):
    nv = Nvml(fake)
    nv.open()
    assert [g.uuid for g in nv.gpus()] == [U0, U1]
    assert nv.resolve("1").uuid == U1
    assert nv.resolve(U0).index == 0
    assert nv.resolve("GPU-bbbb").uuid == U1
    with pytest.raises(UnknownGpu) as exc:
        nv.resolve("7")
    assert U0 in exc.value.message and exc.value.fix
    with pytest.raises(UnknownGpu):
        nv.resolve("GPU-")  # ambiguous prefix
    nv.close()
    assert "nvmlShutdown" in fake.calls


def test_sample_metrics_processes_and_xids(fake):
    nv = Nvml(fake, history_len=3, clock=iter(range(100)).__next__)
    nv.open()
    g = fake.gpu(U0)
    g.util, g.memory_used_mb, g.sm_clock, g.max_sm_clock = 55, 250, 990, 1980
    g.processes = {4242: 200}
    g.process_sm = {4242: 40}
    fake.inject_xid(U0, 31)
    fake.inject_xid(U1, 13)  # U1 cannot register XID events: never delivered
    s0, s1 = nv.sample()
    assert s0.util_pct == 55 and s0.memory_pct == pytest.approx(25.0) and s0.sm_clock_pct == pytest.approx(50.0)
    assert s0.power_w == pytest.approx(70.0) and s1.power_w is None  # NOT_SUPPORTED -> None
    assert [(p.pid, p.used_memory_mb, p.sm_util_pct) for p in s0.processes] == [(4242, 200.0, 40.0)]
    assert s0.xids == (31,) and s1.xids == ()
    assert nv.xid_supported == {U0: True, U1: False}
    assert nv.xid_counts[U0] == 1
    for _ in range(4):
        nv.sample()
    hist = nv.history(U0)
    assert len(hist) == 3  # bounded
    assert [s.ts for s in hist] == sorted(s.ts for s in hist)
    assert nv.latest(U0) is hist[-1]
    assert hist[-1].xids == ()
    d = hist[-1].to_dict()
    assert d["uuid"] == U0 and d["processes"][0]["pid"] == 4242


def test_no_driver_is_reported_plainly():
    nv = Nvml(FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(NoGpuDriver) as exc:
        nv.open()
    assert "no NVIDIA driver" in exc.value.message and "gpu.enabled" in exc.value.fix
    assert not nv.available and nv.sample() == []


def test_real_pynvml_on_this_machine():
    """The real nvidia-ml-py: on a machine without the driver it must say so, not crash."""
    pytest.importorskip("pynvml")
    nv = Nvml()
    try:
        nv.open()
    except NoGpuDriver as exc:
        assert "no NVIDIA driver" in exc.message
        return
    try:
        assert nv.gpus(), "NVML opened, so this machine has a driver and should list GPUs"
        assert len(nv.sample()) == len(nv.gpus())
    finally:
        nv.close()
