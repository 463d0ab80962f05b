"""The errors exgrpo raises for things a user can fix; the CLI prints their message as one line (exit code 2)."""

import contextlib
import warnings


class ExgrpoError(Exception):
    """Base of the user-facing errors."""


class RunDirectoryError(ExgrpoError):
    """A run directory that is in use, already holds another run, or cannot be written."""


class CheckpointError(ExgrpoError):
    """A checkpoint that is missing, incomplete or corrupt."""


class EngineError(ExgrpoError):
    """A rollout engine that cannot be built, cannot do what was asked, or does not hold the trainer's weights."""


class TrainingError(ExgrpoError):
    """Training cannot continue meaningfully (non-finite values, no rewards, too many skipped updates)."""


class ExgrpoWarning(UserWarning):
    """Something the user should know about a run (the CLI prints it as `exgrpo: warning: ...`)."""


class ConfigError(ExgrpoError, ValueError):
    """A config file or override that cannot be honoured; the message names the field."""


def os_cause(error: BaseException) -> str:
    """The operating system's words for a failed I/O call ("No space left on device"), found in the chain of errors
    that writers such as torch.save raise over it; else the error's own message."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return str(error)


class Shutdown(contextlib.ExitStack):
    """An ExitStack whose clean-up cannot hide the error that ended its block: a callback failing while that error
    propagates is reported as a warning and the first error is the one raised."""

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return super().__exit__(exc_type, exc, tb)
        try:
            return super().__exit__(exc_type, exc, tb)
        except BaseException as later:
            if later is exc:
                raise
            warnings.warn(ExgrpoWarning(f"shutting down after the error below also failed: {later}"), stacklevel=2)
            return False
