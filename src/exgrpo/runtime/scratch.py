"""Temporary directories named after the process that owns them, so that the next process to make one removes what
a killed process left (a model-sized weight copy per preemption otherwise)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def owned_temp_dir(prefix: str, parent: str | None = None) -> str:
    """A new directory `<parent>/<prefix><pid>-XXXX` (`parent`: the temp directory by default), after removing
    those of `prefix` whose process is gone."""
    remove_orphans(prefix, parent)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def remove_orphans(prefix: str, parent: str | None = None) -> None:
    """Remove the directories `<parent>/<prefix><pid>-*` whose process no longer exists."""
    for path in Path(parent or tempfile.gettempdir()).glob(f"{prefix}*"):
        pid = path.name[len(prefix):].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
