"""Grading in worker processes with a per-item timeout, so a hung or crashed grader costs one item, not the run."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

_PIPELINE = 2  # items sent ahead to each worker
_START_TIMEOUT_S = 120.0  # a spawned worker imports sympy and math-verify before it reports ready

Grader = Callable[..., float]


# A failed item's kind, and the `stats` count (grading/<count> in the metrics) it goes to.
KINDS = {"raised": "errors", "exited": "errors", "timed out": "timeouts", "crashed": "crashes"}
Failure = tuple[str, str]  # (kind, cause): what went wrong with one item


def _cause(e: BaseException) -> str:
    """The exception and the last frames of its traceback."""
    frames = "".join(traceback.format_list(traceback.extract_tb(e.__traceback__)[-3:]))
    return f"{''.join(traceback.format_exception_only(type(e), e)).strip()}\n{frames.rstrip()}"


def _exits() -> tuple[type[BaseException], ...]:
    """What counts as the grader exiting: SystemExit always; KeyboardInterrupt unless a Ctrl-C would raise it here
    (SIGINT's default handler), where it must stop the caller instead."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        return (SystemExit,)
    return (SystemExit, KeyboardInterrupt)


def _call(grader: Grader, completion: str, gold: str, kwargs: dict[str, Any],
          exits: tuple[type[BaseException], ...] = (SystemExit,)) -> tuple[float, Failure | None]:
    """Grade one item: (score, None), or (0.0, (kind, cause)) if it raised ("raised") or tried to end the process
    with one of `exits` ("exited")."""
    try:
        return float(grader(completion, gold, **kwargs)), None
    except Exception as e:
        return 0.0, ("raised", _cause(e))
    except exits as e:
        return 0.0, ("exited", _cause(e))


class _ItemTimeout(BaseException):
    """Raised by the interval timer in an item that ran past its timeout (a BaseException: a grader's own
    `except Exception` must not swallow it)."""


def _expire(signum, frame):
    raise _ItemTimeout


def _call_within(grader: Grader, completion: str, gold: str, kwargs: dict[str, Any],
                 timeout: float) -> tuple[float, Failure | None]:
    """`_call` stopped by SIGALRM after `timeout` seconds (0.0, "timed out" then); main thread only, `_expire`
    installed."""
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            return _call(grader, completion, gold, kwargs, _exits())
        finally:  # the timer may fire here too, before it is disarmed: the outer handler catches that
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _ItemTimeout:
        return 0.0, _timed_out(timeout)


def _timed_out(timeout: float) -> Failure:
    return "timed out", f"grading took longer than the {timeout:g} s timeout"


def _exit_with(parent: int) -> None:
    """A worker in its own session does not get the terminal's Ctrl-C; it leaves when its parent is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(conn: Connection) -> None:
    """Worker loop: reply to each (grader, completion, gold, kwargs) message with `_call`'s (score, failure)."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    conn.send(None)  # ready: imports are done, so the parent's item deadlines measure grading only
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:  # the pool closed its end
            return
        try:
            grader, completion, gold, kwargs = pickle.loads(message)
        except Exception as e:  # e.g. the grader's module is not importable here: a setup bug, not a 0 score
            conn.send(f"a grading worker cannot load the grader: {e!r}")
            continue
        conn.send(_call(grader, completion, gold, kwargs, (SystemExit, KeyboardInterrupt)))


@dataclass
class Failures:
    """A grader's items and its failed ones by kind ("raised", "exited", "timed out", "crashed"), with the first
    failure's kind and cause (the exception and its traceback's end, or what happened to the item)."""

    graded: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    first: str | None = None
    first_kind: str | None = None

    @property
    def failed(self) -> int:
        return sum(self.kinds.values())

    def add(self, failures: list[Failure | None]) -> None:
        self.graded += len(failures)
        for failure in failures:
            if failure is not None:
                self.kinds[failure[0]] = self.kinds.get(failure[0], 0) + 1
                if self.first is None:
                    self.first_kind, self.first = failure

    def merged(self, other: "Failures") -> "Failures":
        kinds = {k: self.kinds.get(k, 0) + other.kinds.get(k, 0) for k in {**self.kinds, **other.kinds}}
        first = (self.first_kind, self.first) if self.first is not None else (other.first_kind, other.first)
        return Failures(self.graded + other.graded, kinds, first[1], first[0])


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection


_WORKER_MAIN = "import sys; from multiprocessing.connection import Connection; " \
               "from exgrpo.rewards.pool import _serve; _serve(Connection(int(sys.argv[1])))"


def _spawn() -> _Worker:
    # A fresh interpreter rather than multiprocessing's spawn, which re-imports the caller's __main__ and so
    # re-runs any user script without an `if __name__ == "__main__"` guard. Fork would copy the trainer's threads.
    parent_conn, child_conn = mp.Pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # graders import as in the parent
    # Its own session: a Ctrl-C at the terminal reaches the trainer (which finishes the step), not the graders.
    proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, str(child_conn.fileno())],
                            pass_fds=(child_conn.fileno(),), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    child_conn.close()  # only the worker holds its end now, so its death shows up as EOF here
    return _Worker(proc, parent_conn)


def _wait_ready(worker: _Worker) -> None:
    try:
        if worker.conn.poll(_START_TIMEOUT_S) and worker.conn.recv() is None:
            return
    except EOFError:
        pass
    raise RuntimeError("a grading worker failed to start; see its traceback above")


def _stop(workers: list[_Worker]) -> None:
    for w in workers:
        w.proc.kill()
        w.proc.wait()
        w.conn.close()
    workers.clear()


class GradingPool:
    """Grades batches in `num_workers` spawned processes, started on first use and reused.

    An item that runs past `timeout` seconds ("timed out"), or whose worker dies ("crashed"), scores 0.0 and the
    worker is replaced; an item whose grader raises ("raised") or raises SystemExit or KeyboardInterrupt ("exited")
    scores 0.0. `num_workers=0` grades serially in-process, each item stopped after `timeout` seconds by an interval
    timer (SIGALRM, so only on the main thread; `timeout=None` grades unbounded). `stats` counts items ("graded",
    which includes the failed ones), "timeouts", "crashes" and "errors" (raised or exited) since creation;
    `pop_stats()` gives the counts since its previous call, `pop_failures()` the failed items per grader and kind
    since its previous call, with the first one's cause. `grade` may be called from any thread, except
    in-process with a timeout (main thread only).
    """

    def __init__(self, num_workers: int = 2, timeout: float | None = 5.0):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 grades in-process), got {num_workers}")
        if timeout is None and num_workers:
            raise ValueError("grading workers need a timeout: it is how a hung worker is told from a slow one")
        self.num_workers = num_workers
        self.timeout = timeout
        self.stats = {"graded": 0, "timeouts": 0, "crashes": 0, "errors": 0}
        self._popped = dict(self.stats)
        self._failures: dict[str, Failures] = {}
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def grade(self, grader: Grader, completions: list[str], golds: list[str], label: str | None = None,
              **grader_kwargs: Any) -> list[float]:
        """Scores of `grader(completion, gold, **grader_kwargs)`; `grader` must be a top-level function. Its raised
        items are counted under `label` (default: the grader's name)."""
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
        with self._lock:
            if self.num_workers == 0:
                results = self._grade_here(grader, completions, golds, grader_kwargs)
            else:
                results = self._grade_in_workers(grader, completions, golds, grader_kwargs)
            self.stats["graded"] += len(results)
            for _, failure in results:
                if failure is not None:
                    self.stats[KINDS[failure[0]]] += 1
            tally = self._failures.setdefault(label or grader.__name__, Failures())
            tally.add([failure for _, failure in results])
        return [score for score, _ in results]

    def pop_failures(self) -> dict[str, Failures]:
        """Per grader label, its items and failed items since the previous pop_failures call."""
        with self._lock:
            failures, self._failures = self._failures, {}
        return failures

    def pop_stats(self) -> dict[str, int]:
        """The `stats` counts since the previous pop_stats call."""
        with self._lock:
            window = {k: v - self._popped[k] for k, v in self.stats.items()}
            self._popped = dict(self.stats)
        return window

    def close(self) -> None:
        """Kill the workers; a later `grade` starts new ones."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _grade_here(self, grader: Grader, completions: list[str], golds: list[str],
                    kwargs: dict[str, Any]) -> list[tuple[float, Failure | None]]:
        if self.timeout is None:
            return [_call(grader, c, g, kwargs, _exits()) for c, g in zip(completions, golds)]
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"in-process grading (num_workers=0) stops an item after {self.timeout:g} s with "
                               "SIGALRM, which only the main thread receives: grade from the main thread, use "
                               "grading workers, or pass timeout=None")
        previous = signal.signal(signal.SIGALRM, _expire)
        try:
            results = [_call_within(grader, c, g, kwargs, self.timeout) for c, g in zip(completions, golds)]
        finally:
            signal.signal(signal.SIGALRM, previous)
        return results

    def _start(self) -> None:
        self._workers[:] = [_spawn() for _ in range(self.num_workers)]
        # Holds the worker list, not self, so it also runs at interpreter exit or when the pool is collected.
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        try:
            for w in self._workers:
                _wait_ready(w)
        except BaseException:
            self._finalizer()
            raise

    def _replace(self, worker: _Worker) -> _Worker:
        _stop([worker])
        new = _spawn()
        self._workers[self._workers.index(worker)] = new
        _wait_ready(new)
        return new

    def _grade_in_workers(self, grader: Grader, completions: list[str], golds: list[str],
                          kwargs: dict[str, Any]) -> list[tuple[float, Failure | None]]:
        if not self._workers:
            self._start()
        batch = _Batch(self, grader, completions, golds, kwargs)
        try:
            while batch.pending():
                batch.send_ahead()
                if batch.deadlines:
                    batch.collect()
        except BaseException:
            self._finalizer()  # busy workers' late replies would be read as the next call's scores; restart all
            raise
        return batch.scores


class _Batch:
    """One `grade` call's items over the pool's workers. Each worker holds up to _PIPELINE items, so it starts the
    next one without waiting for a round trip to this process; only the item it is working on (the head of its
    queue) has a deadline."""

    def __init__(self, pool: GradingPool, grader: Grader, completions: list[str], golds: list[str],
                 kwargs: dict[str, Any]):
        self.pool, self.grader, self.completions, self.golds, self.kwargs = pool, grader, completions, golds, kwargs
        self.scores: list[tuple[float, Failure | None]] = [(0.0, None)] * len(completions)
        self.todo = deque(range(len(completions)))
        self.queues: dict[Connection, tuple[_Worker, deque[int]]] = {w.conn: (w, deque()) for w in pool._workers}
        self.deadlines: dict[Connection, float] = {}

    def pending(self) -> bool:
        return bool(self.todo) or any(q for _, q in self.queues.values())

    def send_ahead(self) -> None:
        """Fill every worker's queue from the items not yet sent."""
        for conn, (w, queue) in list(self.queues.items()):
            while self.todo and len(queue) < _PIPELINE:
                i = self.todo.popleft()
                try:
                    w.conn.send((self.grader, self.completions[i], self.golds[i], self.kwargs))
                except (BrokenPipeError, ConnectionResetError):
                    self.todo.appendleft(i)
                    if not queue:  # died while idle (e.g. OOM-killed): a new worker takes the item
                        self._replace(conn)
                    break  # otherwise its pending replies, then EOF, are read by collect
                if not queue:
                    self.deadlines[conn] = time.monotonic() + self.pool.timeout
                queue.append(i)

    def collect(self) -> None:
        """Wait for the first reply or deadline; read every reply there is, replace dead and overdue workers."""
        wait(list(self.deadlines), timeout=max(0.0, min(self.deadlines.values()) - time.monotonic()))
        now = time.monotonic()
        for conn in list(self.deadlines):
            w, queue = self.queues[conn]
            while queue and conn.poll():
                try:
                    result = conn.recv()
                except (EOFError, ConnectionResetError):  # it died mid-item (segfault, os._exit, OOM kill)
                    self._replace(conn, "crashed")
                    break
                if isinstance(result, str):
                    raise RuntimeError(result)
                self.scores[queue.popleft()] = result
                self.deadlines[conn] = now + self.pool.timeout  # the next queued item started about now
            else:
                if not queue:
                    del self.deadlines[conn]
                elif self.deadlines[conn] <= now:
                    self._replace(conn, "timed out")

    def _replace(self, conn: Connection, kind: str | None = None) -> None:
        """A new worker for a lost one; its queued items go back to be sent, except the one it was working on when
        it was lost on an item (`kind` "crashed" or "timed out"): that one scores 0 as such a failure."""
        w, queue = self.queues.pop(conn)
        lost = queue.popleft() if kind else None
        self.todo.extendleft(reversed(queue))
        self.deadlines.pop(conn, None)
        new = self.pool._replace(w)  # stops `w` first, so its exit status is known below
        if lost is not None:
            self.scores[lost] = 0.0, _timed_out(self.pool.timeout) if kind == "timed out" else \
                ("crashed", f"its grading worker died ({_exit_status(w.proc.returncode)})")
        self.queues[new.conn] = (new, deque())


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
