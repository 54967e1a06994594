import os
from pathlib import Path

import pytest

from reamer.host import topology as topology_module
from reamer.host.errors import HostError
from reamer.host.topology import Cpu, read_topology

FLAGS = ("avx2", "AVX512F", "sse4_2")

# 2 sockets x 2 cores x 2 threads, Linux numbering: siblings are n and n+4.
#   cpu: package, core
LAYOUT = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def make_sysfs(root: Path, online: str = "0-7", with_cache: bool = True, with_numa: bool = True) -> Path:
    cpu_root = root / "devices/system/cpu"
    _write(cpu_root / "online", online)
    for cpu, (package, core) in LAYOUT.items():
        cpu_dir = cpu_root / f"cpu{cpu}"
        _write(cpu_dir / "topology/physical_package_id", str(package))
        _write(cpu_dir / "topology/core_id", str(core))
        if with_cache:
            _write(cpu_dir / "cache/index0/level", "1")
            _write(cpu_dir / "cache/index0/id", str(cpu % 4))
            _write(cpu_dir / "cache/index3/level", "3")
            _write(cpu_dir / "cache/index3/id", str(package))
            _write(cpu_dir / "cache/index3/shared_cpu_list", "0-1,4-5" if package == 0 else "2-3,6-7")
        if with_numa:
            (cpu_dir / f"node{package}").mkdir(parents=True)
    if with_numa:
        _write(root / "devices/system/node/node0/cpulist", "0-1,4-5")
        _write(root / "devices/system/node/node1/cpulist", "2-3,6-7")
    return root


def test_two_socket_smt_machine(tmp_path: Path) -> None:
    topo = read_topology(make_sysfs(tmp_path), isa_flags=FLAGS, model_name="Fake Xeon")
    assert topo.cpu_ids() == list(range(8))
    assert topo.cpu(6) == Cpu(id=6, core_id=0, package_id=1, numa_node=1, l3_id=1)
    # whole physical cores, node 0 first, siblings together
    assert topo.physical_cores() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert topo.siblings(5) == (1, 5)
    assert topo.numa_nodes() == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}
    assert topo.l3_groups() == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}
    assert topo.model_name == "Fake Xeon"
    assert topo.isa_flags == ("avx2", "avx512f", "sse4_2")
    assert topo.has_isa("AVX512F") and not topo.has_isa("amx_tile")


def test_offline_cpus_are_left_out(tmp_path: Path) -> None:
    topo = read_topology(make_sysfs(tmp_path, online="0-6"), isa_flags=(), model_name="x")
    assert 7 not in topo.cpu_ids()
    assert topo.physical_cores()[-1] == (3,)
    assert topo.siblings(3) == (3,)
    with pytest.raises(KeyError, match="not an online CPU"):
        topo.cpu(7)


def test_numa_from_node_cpulist_when_cpu_links_missing(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path)
    for cpu in LAYOUT:
        for link in (root / f"devices/system/cpu/cpu{cpu}").glob("node*"):
            link.rmdir()
    topo = read_topology(root, isa_flags=(), model_name="x")
    assert topo.numa_nodes() == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}


def test_tolerates_missing_cache_and_numa(tmp_path: Path) -> None:
    topo = read_topology(make_sysfs(tmp_path, with_cache=False, with_numa=False), isa_flags=(), model_name="x")
    assert topo.numa_nodes() == {0: list(range(8))}
    # without L3 information each package is one last-level-cache group
    assert topo.l3_groups() == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}
    assert topo.physical_cores() == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_missing_sysfs_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="online CPU list"):
        read_topology(tmp_path, isa_flags=(), model_name="x")


def test_real_sys_matches_the_kernel() -> None:
    topo = read_topology("/sys")
    assert len(topo.cpu_ids()) == os.cpu_count()
    assert os.sched_getaffinity(0) <= set(topo.cpu_ids())
    assert sorted(cpu for core in topo.physical_cores() for cpu in core) == topo.cpu_ids()
    assert topo.model_name and topo.model_name != "unknown"
    if os.uname().machine == "x86_64":
        assert topo.has_isa("sse2")


def test_cpuinfo_is_called_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import cpuinfo

    calls = []

    def fake_info():
        calls.append(1)
        return {"brand_raw": "Counted CPU", "flags": ["fma"]}

    topology_module._cpuinfo.cache_clear()
    monkeypatch.setattr(cpuinfo, "get_cpu_info", fake_info)
    monkeypatch.setattr(topology_module, "_proc_cpuinfo_fields", lambda: {})  # force the py-cpuinfo path
    try:
        root = make_sysfs(tmp_path)
        first = read_topology(root)
        second = read_topology(root)
        assert first.model_name == second.model_name == "Counted CPU"
        assert first.isa_flags == ("fma",)
        assert len(calls) == 1
    finally:
        topology_module._cpuinfo.cache_clear()


def test_model_and_flags_come_from_proc_cpuinfo_when_it_has_them(tmp_path: Path) -> None:
    cpuinfo_file = tmp_path / "cpuinfo"
    cpuinfo_file.write_text(
        "processor\t: 0\nmodel name\t: Example CPU @ 2.0GHz\nflags\t\t: fpu AVX2 sse2\n\n"
        "processor\t: 1\nmodel name\t: other\n"
    )
    fields = topology_module._proc_cpuinfo_fields(str(cpuinfo_file))
    assert fields["model name"] == "Example CPU @ 2.0GHz"
    assert fields["flags"].split() == ["fpu", "AVX2", "sse2"]
    assert topology_module._proc_cpuinfo_fields(str(tmp_path / "missing")) == {}
