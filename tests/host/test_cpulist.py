import pytest
from hypothesis import given
from hypothesis import strategies as st

from reamer.host.cpulist import format_cpulist, parse_cpulist


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8", [0, 1, 2, 3, 8]),
        ("0", [0]),
        ("", []),
        ("\n", []),
        ("5,1-2,2\n", [1, 2, 5]),
        ("10-11,0,3-3", [0, 3, 10, 11]),
    ],
)
def test_parse_cpulist(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "-1", "1,,x", "0-3;8"])
def test_parse_cpulist_rejects_bad_input_with_the_syntax(text: str) -> None:
    with pytest.raises(ValueError, match=r"bad CPU list .*e\.g\. \"0-3,8,10-11\""):
        parse_cpulist(text)


@pytest.mark.parametrize(
    ("cpus", "text"),
    [([0, 1, 2, 3, 8], "0-3,8"), ([], ""), ([3, 1, 2, 2], "1-3"), ([0, 2, 4], "0,2,4"), ((7,), "7")],
)
def test_format_cpulist(cpus, text: str) -> None:
    assert format_cpulist(cpus) == text


def test_format_rejects_negative() -> None:
    with pytest.raises(ValueError):
        format_cpulist([-1, 2])


@given(st.sets(st.integers(min_value=0, max_value=512)))
def test_round_trip(cpus: set[int]) -> None:
    text = format_cpulist(cpus)
    assert parse_cpulist(text) == sorted(cpus)
    # the shortest form: no two ranges could be merged
    assert text.count(",") + 1 == (len(_runs(sorted(cpus))) if cpus else 1)


def _runs(cpus: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and runs[-1][-1] == cpu - 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return runs
