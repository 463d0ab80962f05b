"""Files that are whole or absent: written next to their destination, flushed to disk, then renamed into place."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def replaced_on_success(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; once the block succeeds it is fsynced and renamed onto `path`.

    If the block raises, `path` is untouched and the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with replaced_on_success(path) as tmp:
        tmp.write_text(text)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(directory: str | os.PathLike) -> None:
    """fsync every file under `directory` (before renaming the directory into place)."""
    for path in Path(directory).rglob("*"):
        if path.is_file():
            fsync_file(path)
