"""`Push` on its own, through a fake `WeightTransport`: a send within the time limit, then the confirmation that
every target loaded every parameter and reads back the version (exgrpo.rollout.push)."""

from __future__ import annotations

import threading

import pytest

from exgrpo.errors import EngineError
from exgrpo.rollout.push import Push


class FakeTransport:
    """A WeightTransport whose targets report what the test sets: the parameters each left unloaded and the
    version each holds. `send` records its calls and the thread they ran on; with `release` it blocks until the
    event is set (a hung transport)."""

    def __init__(self, targets=("server-a", "server-b"), release: threading.Event | None = None):
        self.targets = list(targets)
        self.missing: list[list[str]] = [[] for _ in self.targets]
        self.held: list[str | None] = [None for _ in self.targets]
        self.release, self.sent, self.closed = release, [], False

    def send(self, version, snapshot):
        self.sent.append((version, snapshot, threading.current_thread()))
        if self.release is not None:
            self.release.wait(10)
        self.held = [str(version)] * len(self.targets)

    def unloaded(self):
        return self.missing

    def versions(self):
        return self.held

    def close(self):
        self.closed = True


def test_confirm_passes_when_every_target_loaded_everything_and_holds_the_version():
    t = FakeTransport()
    t.held = ["3", "3"]
    Push(t, timeout=None).confirm(3)


def test_confirm_refuses_a_target_that_left_parameters_unloaded():
    t = FakeTransport()
    t.held = ["3", "3"]
    t.missing[1] = ["model.layers.0.q_proj.weight", "model.layers.0.k_proj.weight", "lm_head.weight", "more"]
    with pytest.raises(EngineError, match=r"did not load 4 parameters of server-b \(e\.g\. "
                                          r"model\.layers\.0\.q_proj\.weight, model\.layers\.0\.k_proj\.weight, "
                                          r"lm_head\.weight\)"):
        Push(t, timeout=None).confirm(3)


def test_confirm_refuses_a_target_that_holds_another_version():
    t = FakeTransport()
    t.held = ["3", "2"]
    with pytest.raises(EngineError, match=r"server-b reports weights version '2' after the push of version 3"):
        Push(t, timeout=None).confirm(3)


def test_confirm_refuses_a_target_that_reports_no_version():
    t = FakeTransport(targets=["the vLLM engine"])
    with pytest.raises(EngineError, match=r"the vLLM engine reports weights version None"):
        Push(t, timeout=None).confirm(1)


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_a_push_sends_then_confirms(timeout):
    t = FakeTransport()
    push = Push(t, timeout)
    push(7, snapshot=[("w", None)])
    assert [(v, s) for v, s, _ in t.sent] == [(7, [("w", None)])]
    # without a limit the transport bounds its own calls, on the caller's thread; with one it runs on a thread
    assert (t.sent[0][2] is threading.current_thread()) == (timeout is None)

    t.missing[0] = ["lm_head.weight"]  # the next push leaves a parameter unloaded: the push itself fails
    with pytest.raises(EngineError, match="did not load 1 parameters of server-a"):
        push(8)
    push.close()
    assert t.closed


def test_a_send_past_the_timeout_is_an_engine_error():
    release = threading.Event()
    t = FakeTransport(release=release)
    try:
        with pytest.raises(EngineError, match=r"took longer than rollout.push_timeout = 0.05 s"):
            Push(t, timeout=0.05)(1)
    finally:
        release.set()  # the send's thread ends
    assert len(t.sent) == 1
