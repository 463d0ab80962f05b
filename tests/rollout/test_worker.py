"""`RolloutWorker` on its own, driving a fake engine: calls run in submission order and each result carries the
version that sampled it, a failed call surfaces to the waiting caller and refuses every later call, a wait past
the timeout is an EngineError (exgrpo.rollout.worker)."""

from __future__ import annotations

import threading

import pytest

from exgrpo.errors import EngineError
from exgrpo.rollout import Rollouts, SamplingSettings
from exgrpo.rollout.worker import RolloutWorker, Sampled

SAMPLING = SamplingSettings(max_new_tokens=4)


class FakeEngine:
    """A CopyHoldingEngine that records its calls in the order they run. `gates[i]`: the i-th call blocks until
    that event is set (`running` is set meanwhile); `failures[i]`: the i-th call raises it. A completion is its
    request's seed."""

    holds_copy, reports_logprobs, takes_snapshots = True, False, False

    def __init__(self):
        self.weights_version = 0
        self.calls: list[tuple] = []
        self.gates: dict[int, threading.Event] = {}
        self.failures: dict[int, BaseException] = {}
        self.running = threading.Event()

    def _call(self, what: tuple) -> None:
        i = len(self.calls)
        self.calls.append(what)
        if i in self.gates:
            self.running.set()
            self.gates[i].wait(10)
        if i in self.failures:
            raise self.failures[i]

    def generate(self, prompt_ids, sampling, seeds) -> Rollouts:
        self._call(("generate", list(seeds)))
        return Rollouts([[s] for s in seeds], [False] * len(seeds))

    def push_weights(self, version, snapshot=None) -> None:
        self._call(("push", version, snapshot))
        self.weights_version = version

    def close(self) -> None:
        pass


@pytest.fixture
def make_worker():
    """A worker over a fresh fake engine; at teardown every gate opens and the worker closes."""
    made = []

    def make(timeout: float = 10.0, gates=(), failures=None) -> tuple[RolloutWorker, FakeEngine]:
        engine = FakeEngine()
        engine.gates = {i: threading.Event() for i in gates}
        engine.failures = dict(failures or {})
        worker = RolloutWorker(engine, timeout)
        made.append((worker, engine))
        return worker, engine

    yield make
    for worker, engine in made:
        for gate in engine.gates.values():
            gate.set()
        worker.close()


def test_calls_run_in_submission_order_and_each_result_carries_its_version(make_worker):
    worker, engine = make_worker(gates=[0])  # everything is queued while the first call runs
    futures = [worker.generate([[1]], SAMPLING, [10]), worker.push(1), worker.generate([[1], [2]], SAMPLING, [11, 12]),
               worker.push(2, snapshot=["copy"]), worker.generate([[1]], SAMPLING, [13])]
    engine.gates[0].set()
    results = [worker.wait(f, "a call") for f in futures]
    assert engine.calls == [("generate", [10]), ("push", 1, None), ("generate", [11, 12]), ("push", 2, ["copy"]),
                            ("generate", [13])]
    sampled = [r for r in results if isinstance(r, Sampled)]
    assert [s.version for s in sampled] == [0, 1, 2]  # sampled after every earlier push, before every later one
    assert [s.rollouts.completion_ids for s in sampled] == [[[10]], [[11], [12]], [[13]]]


def test_as_engine_generates_through_the_queue(make_worker):
    worker, engine = make_worker()
    worker.push(4)
    queued = worker.as_engine("evaluation")
    assert queued.generate([[1]], SAMPLING, [5]).completion_ids == [[5]]
    assert engine.calls == [("push", 4, None), ("generate", [5])]


def test_a_failed_call_surfaces_to_its_caller_and_refuses_every_later_call(make_worker):
    worker, engine = make_worker(gates=[0], failures={1: RuntimeError("CUDA error: device lost")})
    first = worker.generate([[1]], SAMPLING, [1])
    failing = worker.generate([[1]], SAMPLING, [2])
    queued = worker.push(1)  # queued behind the failing call
    engine.gates[0].set()
    assert worker.wait(first, "step 0").version == 0
    with pytest.raises(EngineError, match=r"the rollout engine failed during the rollouts of step 1: "
                                          r"RuntimeError: CUDA error: device lost"):
        worker.wait(failing, "the rollouts of step 1")
    with pytest.raises(EngineError, match=r"failed earlier: RuntimeError: CUDA error: device lost"):
        worker.wait(queued, "weight push")
    later = worker.generate([[1]], SAMPLING, [3])  # submitted after the failure: refused at once
    assert later.done()
    with pytest.raises(EngineError, match=r"failed earlier: RuntimeError: CUDA error: device lost"):
        worker.wait(later, "the rollouts of step 2")
    assert engine.calls == [("generate", [1]), ("generate", [2])]  # nothing ran after the failure


def test_an_engine_error_reaches_the_caller_as_it_is(make_worker):
    error = EngineError("server http://a:8000 reports weights version '1' after the push of version 2")
    worker, _ = make_worker(failures={0: error})
    with pytest.raises(EngineError) as info:
        worker.wait(worker.push(2), "weight push")
    assert info.value is error


def test_a_wait_past_the_timeout_is_an_engine_error(make_worker):
    worker, engine = make_worker(timeout=0.05, gates=[0])  # the engine hangs
    future = worker.generate([[1]], SAMPLING, [1])
    with pytest.raises(EngineError, match=r"gave no rollouts of step 3 within 0.05 s \(rollout.generation_timeout\)"):
        worker.wait(future, "rollouts of step 3")
    engine.gates[0].set()
    assert worker.wait(future, "rollouts of step 3").version == 0  # the call itself went on


def test_close_drops_the_queued_calls(make_worker):
    worker, engine = make_worker(timeout=0.05, gates=[0])
    running = worker.generate([[1]], SAMPLING, [1])
    assert engine.running.wait(10)
    queued = [worker.push(1), worker.generate([[1]], SAMPLING, [2])]
    worker.close()  # the running call is blocked: close gives up on it after the timeout
    assert all(f.cancelled() for f in queued)
    engine.gates[0].set()
    assert running.result(timeout=10).version == 0
    assert engine.calls == [("generate", [1])]
