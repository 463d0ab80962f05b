"""SIGTERM: a request to stop after the current step inside training, a stop at once (with cleanup) outside it."""

import signal

import pytest

from exgrpo.runtime.signals import StopNow, StopRequest, sigterm_stops_at_once


def test_sigterm_outside_training_stops_at_once_and_lets_cleanup_run():
    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(StopNow, match="^SIGTERM: stopped at once$"):
        with sigterm_stops_at_once():
            with StopRequest() as stop:  # training: the first SIGTERM only asks
                signal.raise_signal(signal.SIGTERM)  # runs the handler before it returns
            assert stop.requested == "SIGTERM"
            try:  # start-up or teardown: the run's temporary files are removed on the way out
                signal.raise_signal(signal.SIGTERM)
            finally:
                cleaned.append("temporary model copy")
    assert cleaned == ["temporary model copy"] and signal.getsignal(signal.SIGTERM) is before
