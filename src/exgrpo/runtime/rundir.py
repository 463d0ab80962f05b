"""A run directory belongs to one run: an exclusive lock while a process uses it, and no silent reuse.

The lock is an `flock` on `<run dir>/.lock`, so it is released when its process exits however it exits (a
SIGKILL included); the file records the holder (pid, host, start time) for the message a second run gets. Within
one process the lock is re-entrant: the CLI takes it before loading anything, the trainer takes it again.
Whoever takes the lock first removes the scratch a killed process left in `checkpoints/` (a checkpoint half written
or half deleted): with the lock held, no other process can be writing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from exgrpo.errors import RunDirectoryError, os_cause

#: What a run writes into its directory (besides the lock).
RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "eval_samples.jsonl", "provenance.json", "checkpoints",
             "tensorboard")
_LOCK = ".lock"
#: Name prefixes of checkpoint scratch directories: one being written, one being deleted.
CHECKPOINT_SCRATCH = (".tmp-", ".deleting-")
_held: dict[Path, list] = {}  # resolved directory -> [file object, hold count]


def _key(directory: str | os.PathLike) -> Path:
    return Path(directory).expanduser().resolve()


def writable_directory(directory: str | os.PathLike) -> Path:
    """Create `directory` if needed; a path that cannot be a writable directory is one clear error."""
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirectoryError(f"logging.output_dir {path}: cannot write there ({os_cause(e)})") from None
    return path


def lock_run_directory(directory: str | os.PathLike) -> None:
    """Take the run directory's lock (again, if this process holds it); refuse when another process holds it."""
    key = _key(writable_directory(directory))
    if key in _held:
        _held[key][1] += 1
        return
    f = open(key / _LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunDirectoryError(f"{key} is in use by another run ({holder}); wait for it to finish, or pick another "
                                "logging.output_dir") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
    f.flush()
    _held[key] = [f, 1]
    remove_checkpoint_scratch(key)


def remove_checkpoint_scratch(directory: str | os.PathLike) -> None:
    """Delete the checkpoint scratch directories in `<directory>/checkpoints` (call it holding the run's lock)."""
    root = Path(directory) / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith(CHECKPOINT_SCRATCH):
                shutil.rmtree(p, ignore_errors=True)


def unlock_run_directory(directory: str | os.PathLike) -> None:
    key = _key(directory)
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        entry[0].close()  # closing the file releases the flock


def holds_a_run(directory: str | os.PathLike) -> list[str]:
    """The run files present in `directory` (empty: nothing to lose by starting a run there)."""
    path = Path(directory)
    return [name for name in RUN_FILES if (path / name).exists()]


def checkpoints_gone(directory: str | os.PathLike) -> str | None:
    """Why the run in `directory`, which holds no checkpoint, must have had one (its history in metrics.jsonl goes
    past its first periodic checkpoint, per its config.json's train.save_every), or None when nothing says so."""
    path = Path(directory)
    try:
        every = json.loads((path / "config.json").read_text())["train"]["save_every"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    logged = last_logged_step(path)
    if every and logged > every:
        return (f"its history (metrics.jsonl) reaches step {logged}, past its first checkpoint (step {every}, "
                f"train.save_every {every}), but no checkpoint is left in {path / 'checkpoints'}")
    return None


def last_logged_step(directory: str | os.PathLike) -> int:
    """The last step the run in `directory` logged to its metrics.jsonl (0: none, or no such file); a line that
    cannot be read (a last line cut short by a kill) is passed over."""
    try:
        lines = (Path(directory) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            steps.append(int(json.loads(line)["step"]))
    return max(steps)


def refuse_existing_run(directory: str | os.PathLike) -> None:
    """A fresh run may not start in a directory holding another run's files: the error says how to go on."""
    existing = holds_a_run(directory)
    if existing:
        raise RunDirectoryError(f"{directory} already holds a run ({', '.join(existing)}); continue it with "
                                f"`exgrpo train --resume {directory}`, or start over with --overwrite "
                                "(logging.overwrite=true), which deletes it")


def claim_run_directory(directory: str | os.PathLike, overwrite: bool) -> None:
    """Make `directory` ready for a fresh run: refuse another run's files, or delete them with `overwrite`."""
    if not overwrite:
        refuse_existing_run(directory)
    clear_run(directory)


def clear_run(directory: str | os.PathLike) -> None:
    """Delete a previous run's files (for an explicit overwrite); other files in the directory are kept."""
    for name in holds_a_run(directory):
        target = Path(directory) / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
