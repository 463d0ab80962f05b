"""Shared test parts: the tiny in-process model, a scripted rollout engine and small question sets."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
import torch

from exgrpo.data import Question
from exgrpo.models import load_policy
from exgrpo.rollout import Rollouts

# two cores: two threads, or one per pytest-xdist worker
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

#: the session's temporary directory (set by the first pytest process; its xdist workers inherit it)
SESSION_TMPDIR = "EXGRPO_TESTS_TMPDIR"


def pytest_configure(config):
    """Give the session, and every process it starts, a temporary directory of its own that goes with it: what
    torch's elastic agent (a torchelastic_* log directory per torchrun launch), vLLM (a vllm_dist_* store file when
    stopped at once), torch's compile cache and pytest itself write there is removed when the session ends."""
    if os.environ.get(SESSION_TMPDIR):  # an xdist worker: the directory is the controller's
        return
    root = tempfile.mkdtemp(prefix="exgrpo-tests-")
    os.environ[SESSION_TMPDIR] = os.environ["TMPDIR"] = root
    tempfile.tempdir = None  # read TMPDIR again: pytest's own base temp goes there too
    config.exgrpo_tmpdir = Path(root)


def pytest_collection_modifyitems(config, items):
    """The modules with the most slow tests first, each module's tests together and in their order: two xdist
    workers then do not end on a long test that started last."""
    slow = Counter(item.module for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module])


def pytest_unconfigure(config):
    """Remove the session's temporary directory, saying what the tests' processes left in it besides pytest's own
    base temp (a leak to mend: it would stay in the temp dir outside the suite)."""
    root = getattr(config, "exgrpo_tmpdir", None)
    if root is None:
        return
    left = sorted(p.name for p in root.iterdir() if not p.name.startswith("pytest-of-"))
    if left:
        sys.stderr.write(f"\nthe tests' processes left in the temp dir (removed now): {', '.join(left)}\n")
    shutil.rmtree(root, ignore_errors=True)


def run_cli(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`exgrpo ARGV` in this process, for cases that need no process of their own (locks held by another process,
    kills, signals and rlimits do): its exit code and what it wrote to stdout and stderr, warnings included as the
    CLI prints them. An uncaught exception is returned as a traceback on stderr with exit code 1, as the interpreter
    would."""
    from exgrpo.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    threads, saved_env = torch.get_num_threads(), dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
                sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 2
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["exgrpo", *argv], code, stdout.getvalue(), stderr.getvalue())


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (its children, theirs, ...), from /proc."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = {int(k) for k in (task / "children").read_text().split()} - found
                found |= kids
                todo.extend(kids)
    return found


def alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"  # a zombie is dead
    return False


def _shared_memory_of(pids) -> set[str]:
    """The /dev/shm files that processes `pids` have mapped (and that still exist)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            found |= {line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                      if " /dev/shm/" in line and not line.endswith("(deleted)")}
    return found


def orphaned_semaphores(since: float) -> list[Path]:
    """multiprocessing's named semaphores (/dev/shm/sem.mp-*) made at or after `since` (epoch seconds) that no
    live process has mapped: a process killed with SIGKILL together with its resource tracker leaves them. One in
    use is mapped by every process using it, so these are garbage."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped |= {line.split(None, 5)[5] for line in maps.read_text().splitlines() if " /dev/shm/sem." in line}
    return [p for p in Path("/dev/shm").glob("sem.mp-*") if str(p) not in mapped and p.stat().st_mtime >= since]


def trained_once(tmp_path_factory, name: str, train: Callable[[Path], object]) -> Path:
    """The run directory `name`, trained by `train(directory)` once per test session, by whichever xdist worker
    asks first (a module or session fixture is per worker, so each worker would train its own)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # .../pytest-N/popen-gwK: pytest-N is the session's, shared
        root = root.parent
    run_dir = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (run_dir / "trained").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            train(run_dir)
            (run_dir / "trained").touch()
    return run_dir


def wait_for_checkpoint(run_dir, step: int, process: subprocess.Popen, timeout: float = 600) -> None:
    """Until `process` has written the whole checkpoint of `step` (its manifest); fails if it dies first."""
    deadline = time.monotonic() + timeout
    while not (Path(run_dir) / "checkpoints" / f"step-{step:06d}" / "manifest.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)


def kill_the_learner_only(process: subprocess.Popen) -> tuple[set[int], set[str]]:
    """SIGKILL the learner alone (not its process group, which must have been started as a session of its own);
    every process it started must follow it within seconds. Returns those processes and the shared memory they
    had mapped."""
    processes = descendants(process.pid)
    shared = _shared_memory_of(processes | {process.pid})
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    deadline = time.monotonic() + 20
    try:
        while any(alive(p) for p in processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in processes if alive(p)], "processes outlived their learner"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever the assertion says, nothing is left running
    return processes, shared


class ScriptedEngine:
    """A RolloutEngine whose completions come from `respond(prompt_ids, n) -> (completion ids, truncated)`, n being
    how many times that prompt was asked for before. Records every call (count, sampling, seeds) and weight push.
    It stands for an engine with a copy of the weights (the learner pushes into it): both roles."""

    holds_copy = True
    reports_logprobs = takes_snapshots = False

    def __init__(self, respond: Callable[[list[int], int], tuple[list[int], bool]]):
        self.respond = respond
        self.calls: list[tuple] = []
        self.pushes: list[int] = []
        self.weights_version = 0
        self._asked: Counter = Counter()

    def generate(self, prompt_ids, sampling, seeds) -> Rollouts:
        self.calls.append((len(prompt_ids), sampling, list(seeds)))
        completions, truncated = [], []
        for prompt in prompt_ids:
            key = tuple(prompt)
            ids, cut = self.respond(list(prompt), self._asked[key])
            self._asked[key] += 1
            completions.append(list(ids))
            truncated.append(cut)
        return Rollouts(completions, truncated)

    def push_weights(self, version: int, snapshot=None) -> None:
        self.pushes.append(version)
        self.weights_version = version

    def close(self) -> None:
        pass


@pytest.fixture
def scripted_engine():
    """The ScriptedEngine class (build one with a respond function)."""
    return ScriptedEngine


@pytest.fixture
def tiny_policy():
    """A fresh tiny random-weight Llama and its character-level tokenizer (deterministic: seed 0)."""
    return load_policy("tiny:0")


def make_questions(n: int, prefix: str = "q") -> list[Question]:
    return [Question(f"{prefix}{i}", ({"role": "user", "content": f"{prefix} {i}"},), str(i), {}) for i in range(n)]


@pytest.fixture
def questions():
    """A factory of n simple questions with ids q0, q1, ... and answers "0", "1", ..."""
    return make_questions
