import pytest
from hypothesis import given, settings, strategies as st

from reamer.host.errors import ReamerError
from reamer.plan.coretable import AllocationError, CoreTable
from tests.plan.topologies import make_topology, topologies


def whole_cores(table: CoreTable, cpus) -> bool:
    cpus = set(cpus)
    return all(set(table.topology.siblings(cpu)) <= cpus for cpu in cpus)


def check_invariants(table: CoreTable, reserved: set[int]) -> None:
    seen: set[int] = set()
    for job, cpus in table.jobs().items():
        assert not seen.intersection(cpus), f"{job} shares CPUs with another job"
        assert not reserved.intersection(cpus), f"{job} holds reserved CPUs"
        seen.update(cpus)
    assert table.training_cpus() == seen
    assert set(table.idle_cpus()) == set(table.topology.cpu_ids()) - seen - reserved
    assert table.free_core_count() == len(table.free_cores())


@settings(max_examples=150, deadline=None)
@given(topology=topologies, data=st.data())
def test_random_operations_keep_invariants(topology, data):
    cpu_ids = topology.cpu_ids()
    reserved = set(data.draw(st.sets(st.sampled_from(cpu_ids), max_size=max(1, len(cpu_ids) // 3))))
    table = CoreTable(topology, reserved)
    for step in range(data.draw(st.integers(1, 12))):
        jobs = list(table.jobs())
        if jobs and data.draw(st.booleans()):
            job = data.draw(st.sampled_from(jobs))
            freed = table.release(job)
            assert freed and table.cpus_of(job) == ()
        else:
            job = f"job{step}"
            want = data.draw(st.integers(1, len(table.topology.physical_cores()) + 1))
            free_before = table.free_core_count()
            before = table.jobs()
            if want <= free_before:
                cpus = table.allocate(job, want)
                assert whole_cores(table, cpus)
                assert len({table.topology.siblings(c) for c in cpus}) == want
                assert table.free_core_count() == free_before - want
            else:
                with pytest.raises(AllocationError) as info:
                    table.allocate(job, want)
                assert table.jobs() == before  # refusal changes nothing
                assert f"only {free_before} physical cores are free" in str(info.value)
        check_invariants(table, reserved)


@settings(max_examples=60, deadline=None)
@given(topology=topologies)
def test_allocation_stays_in_one_l3_group_when_it_fits(topology):
    table = CoreTable(topology)
    groups = {}
    for core in topology.physical_cores():
        cpu = topology.cpu(core[0])
        groups.setdefault((cpu.numa_node, cpu.l3_id), []).append(core)
    smallest = min(len(members) for members in groups.values())
    cpus = table.allocate("a", smallest)
    assert len({(topology.cpu(c).numa_node, topology.cpu(c).l3_id) for c in cpus}) == 1


def test_sibling_of_reserved_cpu_is_never_given_to_training():
    topology = make_topology(cores_per_l3=4, smt=2)  # cpus 0-3 and siblings 4-7
    table = CoreTable(topology, reserved={0})
    assert table.free_core_count() == 3
    cpus = table.allocate("train", 3)
    assert 4 not in cpus and 0 not in cpus
    assert cpus == (1, 2, 3, 5, 6, 7)
    assert table.idle_cpus() == [4]  # the reserved core's sibling stays for inference


def test_prefers_the_fuller_group_that_fits_best():
    topology = make_topology(nodes_per_package=2, cores_per_l3=4)  # node0: 0-3, node1: 4-7
    table = CoreTable(topology)
    table.allocate("a", 3)  # node 0 -> 0,1,2
    assert table.cpus_of("a") == (0, 1, 2)
    assert table.allocate("b", 1) == (3,)  # best fit: the last core of node 0, node 1 stays whole
    assert table.allocate("c", 4) == (4, 5, 6, 7)


def test_spans_nodes_when_no_node_fits():
    topology = make_topology(nodes_per_package=2, cores_per_l3=2)
    table = CoreTable(topology)
    assert table.allocate("big", 3) == (0, 1, 2)


def test_shortage_message_names_free_cores_and_fix():
    table = CoreTable(make_topology(cores_per_l3=4), reserved={0})
    table.allocate("a", 2)
    with pytest.raises(AllocationError) as info:
        table.allocate("b", 2)
    error = info.value
    assert isinstance(error, ReamerError)
    assert "only 1 physical cores are free" in error.message
    assert "at most 1" in error.fix
    assert table.cpus_of("b") == ()


def test_bad_requests():
    table = CoreTable(make_topology(cores_per_l3=4))
    table.allocate("a", 1)
    with pytest.raises(AllocationError, match="already holds"):
        table.allocate("a", 1)
    with pytest.raises(AllocationError, match="asks for 0"):
        table.allocate("b", 0)
    with pytest.raises(AllocationError, match="not online"):
        CoreTable(make_topology(), reserved={99})


def test_restore_validates_and_adopts():
    table = CoreTable(make_topology(cores_per_l3=4), reserved={0})
    assert table.restore("a", [2, 1]) == (1, 2)
    assert table.restore("a", [1, 2]) == (1, 2)  # idempotent
    with pytest.raises(AllocationError, match="share CPUs \\[2\\]"):
        table.restore("b", [2, 3])
    with pytest.raises(AllocationError, match="reserved"):
        table.restore("b", [0])
    with pytest.raises(AllocationError, match="not online"):
        table.restore("b", [17])
    assert table.jobs() == {"a": (1, 2)}
    assert table.free_core_count() == 1
    assert table.release("a") == (1, 2)
    assert table.release("a") == ()
    assert table.idle_cpus() == [1, 2, 3]
