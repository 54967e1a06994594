import pytest
from hypothesis import given, settings, strategies as st

from reamer.plan.layout import (
    InstanceShape,
    Layout,
    count_layouts,
    format_layout,
    integer_partitions,
    parse_layout,
)
from reamer.search.method import all_layouts

shapes = st.builds(
    InstanceShape,
    cores=st.integers(1, 64),
    threads=st.integers(1, 64),
    batch=st.integers(1, 256),
)
layouts = st.lists(shapes, min_size=1, max_size=12).map(lambda xs: Layout(tuple(xs)))


def test_parse_simple():
    layout = parse_layout("2x1:b4")
    assert layout.instances == (InstanceShape(1, 1, 4), InstanceShape(1, 1, 4))
    assert layout.total_cores == 2
    assert layout.instance_count == 2


def test_parse_explicit_threads_and_mixed():
    layout = parse_layout("1x2t1:b8")
    assert layout.instances == (InstanceShape(cores=2, threads=1, batch=8),)
    mixed = parse_layout("2x1:b4+1x2:b8")
    assert mixed.instances == (InstanceShape(1, 1, 4), InstanceShape(1, 1, 4), InstanceShape(2, 2, 8))
    assert mixed.total_cores == 4


def test_parse_tolerates_spaces_and_case():
    assert parse_layout(" 2X1:B4 + 1x2t2:b8 ") == parse_layout("2x1:b4+1x2:b8")


def test_format_omits_threads_when_equal_to_cores():
    assert format_layout(Layout.uniform(3, 2, 16)) == "3x2:b16"
    assert format_layout(Layout((InstanceShape(4, 2, 1),))) == "1x4t2:b1"
    assert str(parse_layout("2x1:b4+1x2:b8")) == "2x1:b4+1x2:b8"


@settings(deadline=None)
@given(layouts)
def test_round_trip(layout):
    assert parse_layout(format_layout(layout)) == layout


@settings(deadline=None)
@given(layouts)
def test_canonical_ignores_order(layout):
    assert Layout(tuple(reversed(layout.instances))).canonical() == layout.canonical()
    assert layout.canonical().total_cores == layout.total_cores


@pytest.mark.parametrize(
    "text",
    ["", "   ", "2x1", "2x1:4", "x1:b4", "2x:b4", "2x1:b", "2x1:b4+", "2x0:b4", "0x1:b4", "2x1:b0",
     "1x2t0:b8", "2*1:b4", "two", "2x1:b4;1x2:b8", "-1x1:b4"],
)
def test_bad_syntax_explains_the_syntax(text):
    with pytest.raises(ValueError) as info:
        parse_layout(text)
    message = str(info.value)
    assert "INSTANCESxCORES" in message and "2x1:b4" in message


def test_shape_validation():
    with pytest.raises(ValueError, match="cores"):
        InstanceShape(0, 1, 1)
    with pytest.raises(ValueError, match="batch"):
        InstanceShape(1, 1, 0)


def test_count_matches_the_paper():
    # Cloud Reamer §II: 32 idle cores, max batch 32 -> 8,349 partitions × 32 batch sizes
    assert integer_partitions(32) == 8349
    assert count_layouts(32, 32) == 267_168
    assert count_layouts(32, range(1, 33)) == 267_168


def test_count_small_values():
    assert [integer_partitions(n) for n in range(8)] == [1, 1, 2, 3, 5, 7, 11, 15]
    assert count_layouts(4, [1, 2]) == 10
    assert count_layouts(0, 4) == 0
    # per-instance batch: cores 2 with 2 batch choices: {2:b1},{2:b2},{1b1,1b1},{1b1,1b2},{1b2,1b2}
    assert count_layouts(2, [1, 2], per_instance_batch=True) == 5


@pytest.mark.parametrize("n", [1, 3, 5, 7])
@pytest.mark.parametrize("per_instance", [False, True])
def test_count_equals_enumeration(n, per_instance):
    batches = (1, 4, 16)
    listed = list(all_layouts(n, batches, per_instance_batch=per_instance))
    assert len(listed) == count_layouts(n, batches, per_instance_batch=per_instance)
    assert len({layout.canonical() for layout in listed}) == len(listed)  # all distinct
    assert all(layout.total_cores == n for layout in listed)


def test_count_rejects_bad_input():
    with pytest.raises(ValueError):
        count_layouts(-1, 4)
    with pytest.raises(ValueError):
        count_layouts(4, [])


def test_one_list_of_backends_is_what_every_layer_accepts():
    """reamer.plan.layout.BACKENDS is the only spelling: the job spec, the backends, the CLI's choice and the
    search's installed list all take theirs from it, in its order."""
    from reamer.cli.common import BackendChoice
    from reamer.plan.layout import BACKENDS
    from reamer.search.backends import installed_backends
    from reamer.serve import backends, spec

    assert spec.BACKENDS is BACKENDS and backends.BACKENDS is BACKENDS
    assert tuple(BackendChoice().choices) == BACKENDS
    installed = installed_backends()
    assert installed == [b for b in BACKENDS if b in installed]
    for backend in BACKENDS:
        assert parse_layout(f"2x1:b4@{backend}").backend == backend
