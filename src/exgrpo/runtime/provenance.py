"""When a run ran and which code ran it: `<run dir>/provenance.json`, one session per start or resume.

    {"sessions": [{"started": "2026-12-06T10:00:00+01:00", "from_step": 0, "host": "...",
                   "code": {"exgrpo": "0.1.0", "source": ".../src/exgrpo",
                            "git": {"checkout": "...", "commit": "<40 hex>", "dirty": false, "changes": []}},
                   "ended": "2026-12-06T10:15:00+01:00", "to_step": 60, "stopped_by": null}, ...]}

`git` is found from the package's own source directory: the git checkout that tracks it, or, when none does (an
installed wheel, no git), a sentence saying so. `dirty`: the checkout has changes (`git status --porcelain`,
untracked files included), listed in `changes` (at most `MAX_CHANGES`). A session that never ended by itself or by
a signal (a crash, SIGKILL) keeps `ended` null. Written atomically, like the run's other files.
"""

from __future__ import annotations

import json
import socket
import subprocess
from datetime import datetime
from pathlib import Path

import exgrpo
from exgrpo.errors import RunDirectoryError, os_cause
from exgrpo.runtime.atomic import write_text_atomic

PROVENANCE = "provenance.json"
MAX_CHANGES = 20


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _git(directory: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or f"git {args[0]} failed")
    return done.stdout.rstrip()  # (porcelain lines start with a space)


def git_state(source: Path) -> dict | str:
    """The checkout that tracks `source` (a directory of the package): its commit and uncommitted changes; or why no
    git checkout was found."""
    try:
        _git(source, "ls-files", "--error-unmatch", "--", "__init__.py")  # tracked, not merely inside a checkout
        changes = _git(source, "status", "--porcelain").splitlines()
        return {"checkout": _git(source, "rev-parse", "--show-toplevel"), "commit": _git(source, "rev-parse", "HEAD"),
                "dirty": bool(changes), "changes": changes[:MAX_CHANGES]}
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        reason = " ".join(str(e).split())[:200]
        return f"no git checkout found: none tracks {source} ({reason})"


def code_identity() -> dict:
    """The code running now: exgrpo's version, where its source lies and its git state there."""
    source = Path(exgrpo.__file__).resolve().parent
    return {"exgrpo": exgrpo.__version__, "source": str(source), "git": git_state(source)}


def read_sessions(run_dir: str | Path) -> list[dict]:
    """The run's recorded sessions, oldest first; [] for a run that recorded none (run before this record existed)."""
    path = Path(run_dir) / PROVENANCE
    if not path.exists():
        return []
    try:
        sessions = json.loads(path.read_text())["sessions"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunDirectoryError(f"{path}: unreadable ({e}); {_EXPECTED}") from None
    if not isinstance(sessions, list) or not all(_is_session(s) for s in sessions):
        raise RunDirectoryError(f"{path}: damaged: {_EXPECTED}")
    return sessions


_EXPECTED = ('expected {"sessions": [...]}, each session a mapping with "started", "ended" and "code" (exgrpo\'s '
             "version and its git state); restore the file, or delete it to record sessions afresh")


def _is_session(session) -> bool:
    """Whether `session` has what the report reads of it: its start and end and its code (`code_label`)."""
    if not isinstance(session, dict) or not isinstance(session.get("started"), str):
        return False
    code = session.get("code")
    if not isinstance(code, dict) or "exgrpo" not in code or not isinstance(session.get("ended"), (str, type(None))):
        return False
    git = code.get("git")
    return isinstance(git, str) or (isinstance(git, dict) and isinstance(git.get("commit"), str)
                                    and isinstance(git.get("dirty"), bool))


def _write_sessions(run_dir: str | Path, sessions: list[dict]) -> None:
    path = Path(run_dir) / PROVENANCE
    try:
        write_text_atomic(path, json.dumps({"sessions": sessions}, indent=1))
    except OSError as e:
        raise RunDirectoryError(f"cannot write {path}: {os_cause(e)}") from None


#: the code of steps no recorded session ran (a run resumed after its provenance.json went)
UNRECORDED_CODE = {"exgrpo": None, "git": "not recorded"}


def start_session(run_dir: str | Path, step: int) -> None:
    """Append a session starting (or resuming) the run at `step`, run by the code running now. A resume that finds
    no session recorded first records that the steps before `step` ran by code nobody recorded."""
    sessions = read_sessions(run_dir)
    if step and not sessions:
        sessions = [{"started": f"not recorded ({PROVENANCE} held no session when the run resumed at step {step})",
                     "from_step": 0, "host": None, "code": UNRECORDED_CODE, "ended": None, "to_step": step,
                     "stopped_by": None}]
    session = {"started": _now(), "from_step": step, "host": socket.gethostname(), "code": code_identity(),
               "ended": None, "to_step": None, "stopped_by": None}
    _write_sessions(run_dir, [*sessions, session])


def end_session(run_dir: str | Path, step: int, stopped_by: str | None) -> None:
    """Record the end of the last session at `step` (`stopped_by`: the signal's name, None when it ended by itself)."""
    # [] when the file went while the run ran: this session's start is lost, its end and code are still known
    sessions = read_sessions(run_dir) or [{"started": f"not recorded ({PROVENANCE} went while the run ran)",
                                           "from_step": None, "host": socket.gethostname(), "code": code_identity()}]
    sessions[-1].update(ended=_now(), to_step=step, stopped_by=stopped_by)
    _write_sessions(run_dir, sessions)


def ended_step(run_dir: str | Path) -> int:
    """The step at which the run's last recorded session ended by itself (no signal stopped it, nothing crashed it):
    how far a run that finished got, known also after its checkpoints are removed; 0 when no session did."""
    sessions = read_sessions(run_dir)
    last = sessions[-1] if sessions else {}
    finished = last.get("ended") is not None and last.get("stopped_by") is None
    return int(last.get("to_step") or 0) if finished else 0


def code_label(code: dict) -> str:
    """A session's code in a few words: version, short commit and whether the tree was dirty."""
    git = code["git"]
    if code["exgrpo"] is None:  # UNRECORDED_CODE
        return "not recorded"
    if isinstance(git, str):
        return f"exgrpo {code['exgrpo']}, no git checkout found"
    return f"exgrpo {code['exgrpo']} at {git['commit'][:7]}" + (" (dirty tree)" if git["dirty"] else "")
