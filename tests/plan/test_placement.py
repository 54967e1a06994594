import pytest
from hypothesis import given, settings, strategies as st

from reamer.plan.layout import parse_layout
from reamer.plan.placement import InferenceDemand, PlacedInstance, PlacementResult, place


def online(job, layout=None, cores=None, batch=1):
    return InferenceDemand(job, "online", parse_layout(layout) if layout else None, cores, batch)


def offline(job, batch=1):
    return InferenceDemand(job, "offline", batch=batch)


def all_cpus(result: PlacementResult, job: str) -> list[int]:
    return [cpu for instance in result.assignments[job] for cpu in instance.cpus]


def test_online_gets_exclusive_cores_cut_into_instances():
    result = place([2, 3, 4, 5, 6, 7], [0, 1], [online("web", "2x1:b4+1x2:b8")])
    assert result.pending == []
    instances = result.assignments["web"]
    assert instances == [
        PlacedInstance((2,), 1, 4),
        PlacedInstance((3,), 1, 4),
        PlacedInstance((4, 5), 2, 8),
    ]


def test_online_all_or_nothing_and_priority_order():
    result = place([2, 3, 4], [], [online("first", cores=2), online("second", cores=2), online("third", cores=1)])
    assert all_cpus(result, "first") == [2, 3]
    assert "second" not in result.assignments
    assert result.pending == ["second"]
    assert all_cpus(result, "third") == [4]  # a later, smaller job may still fit


def test_cores_only_demand_is_one_instance_with_threads_equal_cores():
    result = place([0, 1, 2, 3], [], [online("web", cores=3, batch=8)])
    assert result.assignments["web"] == [PlacedInstance((0, 1, 2), 3, 8)]


def test_stability_keeps_previous_cpus():
    previous = {"a": [PlacedInstance((5, 6), 2, 4)], "b": [PlacedInstance((2,), 1, 1)]}
    result = place([2, 3, 4, 5, 6, 7], [], [online("a", "1x2:b4"), online("b", "1x1:b1")], previous)
    assert result.assignments["a"] == previous["a"]
    assert result.assignments["b"] == previous["b"]


def test_priority_job_takes_lower_priority_cpus_only_when_needed():
    previous = {"a": [PlacedInstance((2, 3), 2, 1)], "b": [PlacedInstance((4, 5), 2, 1)]}
    # cpu 3 went to training: a needs one more cpu; 6 is fresh, so b keeps its cpus
    result = place([2, 4, 5, 6], [3], [online("a", cores=2), online("b", cores=2)], previous)
    assert set(all_cpus(result, "a")) == {2, 6}
    assert set(all_cpus(result, "b")) == {4, 5}
    # no fresh cpu left: a (earlier) wins, b goes pending
    result = place([2, 4, 5], [3], [online("a", cores=2), online("b", cores=2)], previous)
    assert set(all_cpus(result, "a")) == {2, 5} or set(all_cpus(result, "a")) == {2, 4}
    assert result.pending == ["b"]


def test_offline_uses_idle_and_training_cpus_single_threaded():
    result = place([4, 5, 6], [0, 1], [online("web", cores=1), offline("batch", batch=16)])
    instances = result.assignments["batch"]
    assert all(len(i.cpus) == 1 and i.threads == 1 and i.batch == 16 for i in instances)
    assert {i.cpus[0]: i.on_training for i in instances} == {5: False, 6: False, 0: True, 1: True}


def test_offline_jobs_share_round_robin_and_stay_put():
    result = place([2, 3, 4, 5], [0, 1], [offline("x"), offline("y")])
    x, y = all_cpus(result, "x"), all_cpus(result, "y")
    assert len(x) == len(y) == 3 and not set(x) & set(y)
    assert set(x) | set(y) == {0, 1, 2, 3, 4, 5}
    # a new online job takes cpu 2; the other offline cpus stay where they were
    again = place([2, 3, 4, 5], [0, 1], [online("web", cores=1), offline("x"), offline("y")], result.assignments)
    assert all_cpus(again, "web") == [2]
    moved = {cpu for cpu in {0, 1, 3, 4, 5} if (cpu in x) != (cpu in all_cpus(again, "x"))}
    assert len(moved) <= 1  # at most one cpu changes hands to rebalance


def test_offline_with_no_cpus_is_pending():
    result = place([0], [], [online("web", cores=1), offline("batch")])
    assert result.pending == ["batch"]


def test_bad_demands():
    with pytest.raises(ValueError, match="layout or a core count"):
        InferenceDemand("web", "online")
    with pytest.raises(ValueError, match="kind"):
        InferenceDemand("web", "realtime", cores=1)
    with pytest.raises(ValueError, match="more than once"):
        place([0, 1], [], [online("a", cores=1), online("a", cores=1)])


layouts = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3).map(
    lambda groups: parse_layout("+".join(f"{n}x{c}:b1" for n, c in groups))
)


@settings(max_examples=150, deadline=None)
@given(
    n_cpus=st.integers(1, 16),
    data=st.data(),
)
def test_placement_properties(n_cpus, data):
    cpus = list(range(n_cpus))
    training = set(data.draw(st.sets(st.sampled_from(cpus), max_size=n_cpus)))
    idle = [cpu for cpu in cpus if cpu not in training]
    demands = []
    for index in range(data.draw(st.integers(0, 4))):
        if data.draw(st.booleans()):
            demands.append(InferenceDemand(f"on{index}", "online", layout=data.draw(layouts)))
        else:
            demands.append(offline(f"off{index}"))
    previous = None
    for _ in range(2):  # second round: with the previous placement, and fewer idle cpus
        result = place(idle, training, demands, previous)
        online_cpus: list[int] = []
        for demand in demands:
            if demand.job in result.pending:
                assert demand.job not in result.assignments
                continue
            assigned = all_cpus(result, demand.job)
            if demand.kind == "online":
                assert len(assigned) == demand.layout.total_cores  # all or nothing
                assert [len(i.cpus) for i in result.assignments[demand.job]] == [
                    s.cores for s in demand.layout.instances
                ]
                online_cpus.extend(assigned)
            else:
                assert all(i.threads == 1 and len(i.cpus) == 1 for i in result.assignments[demand.job])
                assert all(i.on_training == (i.cpus[0] in training) for i in result.assignments[demand.job])
        assert len(online_cpus) == len(set(online_cpus)), "online jobs share cpus"
        assert not training.intersection(online_cpus), "online job on training cpus"
        assert set(online_cpus) <= set(idle)
        offline_cpus = [c for d in demands if d.kind == "offline" and d.job in result.assignments
                        for c in all_cpus(result, d.job)]
        assert len(offline_cpus) == len(set(offline_cpus))
        assert not set(offline_cpus) & set(online_cpus)
        if any(d.kind == "offline" for d in demands):
            # every cpu not used by online work runs offline work
            assert set(offline_cpus) == (set(idle) - set(online_cpus)) | training
        # placing again from its own result changes nothing (no needless worker restarts)
        assert place(idle, training, demands, result.assignments) == result
        previous = result.assignments
        if idle:
            training = training | {idle[-1]}
            idle = idle[:-1]
