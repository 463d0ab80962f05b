"""A rollout engine driven from a background thread, so that generation for later steps overlaps the learner's
update (`rollout.mode: async`).

The worker runs the engine's calls one at a time, in the order they were submitted: generation requests and
weight pushes. Order is the whole contract: a generation submitted after the push of version v samples from v,
and one submitted before it from the version before. Every result carries the weights version the engine held
when it sampled, so the caller can check the schedule instead of trusting it.

A failed call fails its future; the worker then refuses every later call with the same error (an engine that
died does not come back), and a caller that waits longer than `timeout` gets an EngineError instead of a hang.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from exgrpo.errors import EngineError
from exgrpo.rollout.base import CopyHoldingEngine, Rollouts, SamplingSettings, Weights


@dataclass
class Sampled:
    """One generation call's rollouts and the weights version (applied optimizer steps) that sampled them."""

    rollouts: Rollouts
    version: int


class RolloutWorker:
    """Runs `engine.generate` and weight pushes in submission order on a thread of its own.

    Args:
        engine: an engine with its own copy of the weights (both roles: sampling and receiving weights).
        timeout: seconds a caller waits for any one result before the run stops with an EngineError.
    """

    def __init__(self, engine: CopyHoldingEngine, timeout: float):
        self.engine, self.timeout = engine, timeout
        self._jobs: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        self.engine_busy = 0.0  # seconds spent in engine calls since the last `take_times`
        self.learner_waiting = 0.0  # seconds callers spent waiting for results since the last `take_times`
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="exgrpo-rollout-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings,
                 seeds: Sequence[int]) -> concurrent.futures.Future:
        """A future of `Sampled`: the rollouts of these requests, sampled after every earlier push."""
        prompts, seeds = [list(p) for p in prompt_ids], list(seeds)
        def run() -> Sampled:
            return Sampled(self.engine.generate(prompts, sampling, seeds), self.engine.weights_version)

        return self._submit(run)

    def push(self, version: int, snapshot: Weights | None = None) -> concurrent.futures.Future:
        """Load the learner's weights, now at `version`, into the engine (`engine.push_weights`) once every
        earlier call is done. The push reads the learner's weights on the worker thread: the learner must not
        change them until this future is done (`wait`), unless `snapshot` is a copy of them to send instead."""
        return self._submit(lambda: self.engine.push_weights(version, snapshot))

    def wait(self, future: concurrent.futures.Future, what: str):
        """The result of `future`, counting the wait as learner idle time; an EngineError past `timeout`."""
        start = time.perf_counter()
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise EngineError(f"the rollout engine gave no {what} within {self.timeout:g} s "
                              "(rollout.generation_timeout): it is hung or far too slow") from None
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"the rollout engine failed during {what}: {type(e).__name__}: {e}") from e
        finally:
            self.learner_waiting += time.perf_counter() - start

    def as_engine(self, what: str = "evaluation") -> "_Queued":
        """A RolloutEngine whose generate goes through the queue and waits (evaluation between steps)."""
        return _Queued(self, what)

    def take_times(self) -> dict[str, float]:
        """Seconds since the last call: the engine idle (no call running; a call is counted when it ends) and the
        learner waiting for results."""
        now = time.perf_counter()
        wall, busy, waiting = now - self._started, self.engine_busy, self.learner_waiting
        self._started, self.engine_busy, self.learner_waiting = now, 0.0, 0.0
        return {"async/engine_idle": max(wall - busy, 0.0), "async/learner_idle": waiting}

    def close(self) -> None:
        """Stop after the running call (the calls still queued are dropped)."""
        try:
            while True:
                job = self._jobs.get_nowait()
                if job is not None:
                    job[1].cancel()
        except queue.Empty:
            pass
        self._jobs.put(None)
        self._thread.join(timeout=self.timeout)

    # ------------------------------------------------------------------ the thread
    def _submit(self, call: Callable) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._failure is not None:
            future.set_exception(self._failed_earlier())
        else:
            self._jobs.put((call, future))
        return future

    def _failed_earlier(self) -> EngineError:
        return EngineError(f"the rollout engine failed earlier: {type(self._failure).__name__}: {self._failure}")

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, future = job
            if self._failure is not None:
                future.set_exception(self._failed_earlier())
                continue
            start = time.perf_counter()
            try:
                future.set_result(call())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting learner
                self._failure = e
                future.set_exception(e)
            finally:
                self.engine_busy += time.perf_counter() - start


class _Queued:
    """A RolloutEngine over a RolloutWorker: generate submits and waits (the sampling role alone: weights reach the
    engine through `RolloutWorker.push`)."""

    holds_copy = True

    def __init__(self, worker: RolloutWorker, what: str):
        self.worker, self.what = worker, what
        self.reports_logprobs = worker.engine.reports_logprobs

    def generate(self, prompt_ids, sampling, seeds) -> Rollouts:
        return self.worker.wait(self.worker.generate(prompt_ids, sampling, seeds), self.what).rollouts

    def close(self) -> None:
        pass
