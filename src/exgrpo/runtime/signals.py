"""Stopping on request: the first SIGINT/SIGTERM asks to stop after the current unit of work, a second stops at
once."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class StopNow(BaseException):
    """A second SIGINT/SIGTERM, or a SIGTERM outside training (`sigterm_stops_at_once`): stop at once, without
    checkpointing the unit of work in progress (a BaseException, like KeyboardInterrupt: a reward function's
    `except Exception` must not swallow it)."""

    def __init__(self, signal_name: str, again: bool = True):
        super().__init__(f"{signal_name}{' again' if again else ''}: stopped at once")
        self.signal_name = signal_name


class StopRequest:
    """A context in which SIGINT/SIGTERM set `requested` (the signal's name) instead of interrupting; the first
    says so on stderr at once, a second raises `StopNow`."""

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            raise StopNow(name)
        self.requested = name
        # os.write, not print: a handler that runs while the main thread is inside a print would re-enter it.
        os.write(2, f"exgrpo: {name}: stopping after this step (a checkpoint follows); {name} again stops at "
                    "once, from the last checkpoint\n".encode())

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _stop_now(signum, frame):
    raise StopNow(signal.Signals(signum).name, again=False)


@contextlib.contextmanager
def sigterm_stops_at_once():
    """Outside a `StopRequest` (start-up, the evaluation before training, teardown), SIGTERM raises `StopNow` as
    SIGINT raises KeyboardInterrupt: `finally` blocks then remove temporary model copies, which SIGTERM's default
    action (the process dies) skips."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _stop_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
