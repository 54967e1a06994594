"""Dynamic batcher over real instance workers (spawned processes, tiny ONNX models)."""
import asyncio
import os
import signal

import numpy as np
import pytest

from reamer.serve.backends import open_backend
from reamer.serve.runtime.batcher import DynamicBatcher, Overloaded
from reamer.serve.models import build_model
from reamer.serve.spec import InstanceSpec, read_events
from reamer.serve.runtime.instances import InstanceCrashed, InstanceWorker

CPU = sorted(os.sched_getaffinity(0))[-1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {f: build_model(f, d / f"{f}.onnx").path for f in ("tiny", "multi-io")}


@pytest.fixture
def make_worker(tmp_path):
    made = []

    def make(model, max_batch=4, index=None):
        w = InstanceWorker(len(made) if index is None else index, InstanceSpec([CPU], 1, max_batch), model,
                           run_dir=str(tmp_path))
        made.append(w)
        w.start()
        return w

    yield make
    for w in made:
        for sig in (signal.SIGCONT,):
            if w.alive:
                os.kill(w.pid, sig)
        w.stop(grace_s=5)


async def until(pred, timeout=30.0, what="condition"):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_queued_requests_share_a_batch_and_get_their_own_outputs(models, make_worker):
    w = make_worker(models["tiny"], max_batch=4)
    ref = open_backend("onnxruntime", models["tiny"], 1)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((b, 16)).astype(np.float32) for b in (1, 2, 1, 1)]

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        os.kill(w.pid, signal.SIGSTOP)  # first request stays in flight; the rest queue up behind it
        first = asyncio.ensure_future(b.infer({"input": xs[0]}))
        await until(lambda: w.busy, what="first batch in flight")
        rest = [asyncio.ensure_future(b.infer({"input": x})) for x in xs[1:]]
        await until(lambda: len(b._queue) == 3, what="three queued requests")
        os.kill(w.pid, signal.SIGCONT)
        outs = await asyncio.gather(first, *rest)
        await b.close()
        return outs

    outs = asyncio.run(main())
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out["output"], ref.run({"input": x})["output"], rtol=1e-5)
    # 1 alone, then 2+1+1 = 4 samples together in one batch.
    assert (w.batches_run, w.samples_run) == (2, 5)


def test_multi_input_requests_are_concatenated_and_split(models, make_worker):
    w = make_worker(models["multi-io"], max_batch=8)
    ref = open_backend("onnxruntime", models["multi-io"], 1)
    rng = np.random.default_rng(1)
    reqs = [{"x": rng.standard_normal((b, 8)).astype(np.float32), "ids": rng.integers(0, 10, (b, 4))}
            for b in (3, 1, 2)]

    async def main():
        b = DynamicBatcher(slo_ms=1000.0)
        b.add_instance(w)
        outs = await asyncio.gather(*(b.infer(r) for r in reqs))
        await b.close()
        return outs

    for r, out in zip(reqs, asyncio.run(main())):
        want = ref.run(r)
        assert out["scores"].shape == (r["x"].shape[0], 4)
        np.testing.assert_allclose(out["scores"], want["scores"], rtol=1e-5)
        np.testing.assert_array_equal(out["id_sum"], want["id_sum"])


def test_sheds_when_queue_would_miss_slo_but_never_while_an_instance_idles(models, make_worker):
    a = make_worker(models["tiny"], max_batch=1)
    b2 = make_worker(models["tiny"], max_batch=1)
    x = {"input": np.zeros((1, 16), np.float32)}

    async def main():
        b = DynamicBatcher(slo_ms=1000.0)
        b.add_instance(a)
        os.kill(a.pid, signal.SIGSTOP)
        a.latency_ewma_s = 0.5  # as if each batch had measured 500 ms: 2 samples/s
        held = asyncio.ensure_future(b.infer(x))
        await until(lambda: a.busy, what="batch in flight")
        queued = asyncio.ensure_future(b.infer(x))  # 1 queued: 0.5 + 0.5 s, within the SLO
        await until(lambda: len(b._queue) == 1, what="one queued")
        with pytest.raises(Overloaded) as err:
            await b.infer(x)  # would be 1.5 s > 1 s SLO
        assert "SLO" in err.value.message and err.value.fix
        # A second, idle instance must take work even though the estimate says "over".
        b.add_instance(b2)
        b2.latency_ewma_s = 10.0
        await until(lambda: any(l.idle for l in b._lanes if l.worker is b2), what="idle second instance")
        more = await asyncio.wait_for(b.infer(x), 30)
        os.kill(a.pid, signal.SIGCONT)
        await asyncio.gather(held, queued)
        snap = b.stats.snapshot()
        await b.close()
        return more, snap

    more, snap = asyncio.run(main())
    assert more["output"].shape == (1, 4)
    assert snap.shed == 1 and snap.requests == 3


def test_a_request_that_arrives_late_in_a_batch_is_judged_by_what_is_left_of_it(models, make_worker):
    a = make_worker(models["tiny"], max_batch=1)
    x = {"input": np.zeros((1, 16), np.float32)}

    async def main():
        b = DynamicBatcher(slo_ms=1000.0)
        b.add_instance(a)
        os.kill(a.pid, signal.SIGSTOP)
        a.latency_ewma_s = 0.6  # each batch 600 ms: a whole one in flight plus its own is 1.2 s > 1 s
        held = asyncio.ensure_future(b.infer(x))
        await until(lambda: a.busy, what="batch in flight")
        lane = next(lane for lane in b._lanes if lane.worker is a)
        lane.busy_since -= 0.5  # 500 ms of it have run: 100 ms left (counted as 150) + 600 ms fits
        late = asyncio.ensure_future(b.infer(x))
        await until(lambda: len(b._queue) == 1, what="the late request queued, not shed")
        lane.busy_since += 0.5  # as if the batch had only just started: 600 + 600 (queued) + 600 ms
        with pytest.raises(Overloaded):
            await b.infer(x)
        os.kill(a.pid, signal.SIGCONT)
        await asyncio.gather(held, late)
        snap = b.stats.snapshot()
        await b.close()
        return snap

    snap = asyncio.run(main())
    assert snap.shed == 1 and snap.requests == 2  # answered: the one in flight and the late one


def test_requests_that_would_ride_in_one_batch_with_the_queue_are_not_counted_twice(models, make_worker):
    a = make_worker(models["tiny"], max_batch=4)
    x = {"input": np.zeros((1, 16), np.float32)}

    async def main():
        b = DynamicBatcher(slo_ms=1200.0)
        b.add_instance(a)
        os.kill(a.pid, signal.SIGSTOP)
        a.latency_ewma_s, a.batch_ewma = 0.5, 4.0  # batches of 4 in 500 ms: 8 samples/s
        held = asyncio.ensure_future(b.infer(x))
        await until(lambda: a.busy, what="batch in flight")
        # 500 ms left of the batch in flight, then one batch of 4: the 4th queued request ends with the 1st at
        # 1.0 s (counting each queued sample at 8/s would put it at 1.375 s and shed it)
        queued = [asyncio.ensure_future(b.infer(x)) for _ in range(4)]
        await until(lambda: len(b._queue) == 4, what="four queued, none shed")
        with pytest.raises(Overloaded):
            await b.infer(x)  # a whole batch ahead of it: 0.5 + 0.5 + 0.5 s > 1.2 s
        os.kill(a.pid, signal.SIGCONT)
        await asyncio.gather(held, *queued)
        snap = b.stats.snapshot()
        await b.close()
        return snap

    snap = asyncio.run(main())
    assert snap.shed == 1 and snap.requests == 5


def test_crash_fails_in_flight_batch_clearly_then_recovers(models, make_worker, tmp_path):
    w = make_worker(models["tiny"], max_batch=4)
    x = {"input": np.ones((1, 16), np.float32)}

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        old = w.pid
        os.kill(old, signal.SIGSTOP)
        doomed = asyncio.ensure_future(b.infer(x))
        await until(lambda: w.busy, what="batch in flight")
        os.kill(old, signal.SIGKILL)
        with pytest.raises(InstanceCrashed) as err:
            await doomed
        await until(lambda: w.ready and w.pid != old, what="restart")
        out = await asyncio.wait_for(b.infer(x), 60)
        await b.close()
        return err.value, out

    err, out = asyncio.run(main())
    assert "instance 0 crashed" in str(err) and "retry" in str(err)
    assert out["output"].shape == (1, 4)
    assert [e["kind"] for e in read_events(tmp_path)[0]] == ["worker_crashed", "worker_restarted"]


def test_removing_an_instance_finishes_its_in_flight_batch(models, make_worker):
    w = make_worker(models["tiny"], max_batch=2)
    x = {"input": np.ones((2, 16), np.float32)}

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        os.kill(w.pid, signal.SIGSTOP)
        pending = asyncio.ensure_future(b.infer(x))
        await until(lambda: w.busy, what="batch in flight")
        removal = asyncio.ensure_future(b.remove_instance(w))
        await asyncio.sleep(0.05)
        os.kill(w.pid, signal.SIGCONT)
        out = await pending
        await removal
        return out, b

    out, b = asyncio.run(main())
    assert out["output"].shape == (2, 4)
    assert not w.alive and b.workers == []


def test_a_batch_skips_a_request_too_large_for_it_and_takes_the_ones_behind():
    """Regression: taking requests from behind a skipped one compared requests (and so their tensors)
    for equality, which raised inside the instance's serving loop and stopped it."""
    from reamer.serve.runtime.batcher import _Request

    async def main():
        b = DynamicBatcher(slo_ms=None)
        loop = asyncio.get_running_loop()
        reqs = [_Request({"x": np.full((n, 4), float(i), np.float32)}, n, ("x",), 0.0, loop.create_future())
                for i, n in enumerate((1, 2, 1))]
        b._queue.extend(reqs)
        return reqs, b._take(2), b._queue

    reqs, taken, left = asyncio.run(main())
    assert taken == [reqs[0], reqs[2]] and left == [reqs[1]]


def test_a_request_the_model_refuses_fails_alone_not_the_batch_it_was_in(make_worker, tmp_path):
    from reamer.serve.runtime.instances import InferenceFailed
    from tests.serve.bertlike import bert_feeds, build_bertlike

    w = make_worker(build_bertlike(tmp_path / "bertlike.onnx"), max_batch=4)
    good = [bert_feeds(1, 8, word_id=i) for i in (1, 2)]
    bad = bert_feeds(1, 8, type_id=5)  # out of the token-type table's range

    async def main():
        b = DynamicBatcher(slo_ms=None)
        b.add_instance(w)
        os.kill(w.pid, signal.SIGSTOP)
        first = asyncio.ensure_future(b.infer(good[0]))
        await until(lambda: w.busy, what="first batch in flight")
        rest = [asyncio.ensure_future(b.infer(x)) for x in (bad, good[1])]
        await until(lambda: len(b._queue) == 2, what="two queued requests")
        os.kill(w.pid, signal.SIGCONT)
        outs = await asyncio.gather(first, *rest, return_exceptions=True)
        await b.close()
        return outs

    first, refused, second = asyncio.run(main())
    assert isinstance(refused, InferenceFailed) and "out of data bounds" in refused.message
    assert first["last_hidden_state"].shape == second["last_hidden_state"].shape == (1, 8, 384)
    # the batch of two was refused, then each ran alone: the good one answered (batches_run counts the
    # batches that succeeded), and the instance kept serving
    assert (w.batches_run, w.samples_run) == (2, 2) and w.restarts == 0
    assert not [e for e in read_events(tmp_path)[0] if e["kind"] == "worker_crashed"]
