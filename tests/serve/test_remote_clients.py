"""Clients on other hosts (issue 12): an online job listens on every interface by default and answers a
tritonclient in a network namespace of its own (over a veth pair, not loopback); bound to one address it
answers only there. Loopback clients keep working either way."""
import httpx
import pytest

from reamer.serve.models import build_model
from tests.serve.jobs import RunningJob
from tests.serve.netns import TRITON_CLIENT, netns  # noqa: F401 - the fixture

pytest.importorskip("tritonclient.http")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("m") / "tiny.onnx").path


@pytest.fixture
def start_job(tiny, tmp_path):
    jobs = []

    def start(**fields):
        jobs.append(RunningJob(tiny, tmp_path, "tiny", run_name=f"run{len(jobs)}", **fields))
        return jobs[-1].status

    yield start
    for job in jobs:
        job.stop()


def test_default_job_answers_a_client_in_another_network_namespace(start_job, netns):  # noqa: F811
    st = start_job()
    done = netns.python(TRITON_CLIENT, f"http://{netns.host_address}:{st.port}", "tiny")
    assert done.returncode == 0 and done.stdout.strip() == "(2, 4)", done.stderr
    # and on loopback, as before
    assert httpx.get(f"http://127.0.0.1:{st.port}/v2/health/ready", timeout=10).status_code == 200


def test_job_bound_to_loopback_is_not_reachable_from_elsewhere(start_job, netns):  # noqa: F811
    st = start_job(host="127.0.0.1")
    done = netns.python(TRITON_CLIENT, f"http://{netns.host_address}:{st.port}", "tiny")
    assert done.returncode != 0 and "refused" in (done.stderr + done.stdout).lower(), done.stderr
    assert httpx.get(f"http://127.0.0.1:{st.port}/v2/health/ready", timeout=10).status_code == 200


def test_job_bound_to_one_address_answers_there(start_job, netns):  # noqa: F811
    st = start_job(host=netns.host_address)
    done = netns.python(TRITON_CLIENT, f"http://{netns.host_address}:{st.port}", "tiny")
    assert done.returncode == 0, done.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{st.port}/v2/health/ready", timeout=10)
