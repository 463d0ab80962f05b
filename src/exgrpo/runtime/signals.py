"""Stopping on request: the first SIGINT/SIGTERM asks to stop after the current unit of work, a second interrupts."""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """A context in which SIGINT/SIGTERM set `requested` (the signal's name) instead of interrupting."""

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
