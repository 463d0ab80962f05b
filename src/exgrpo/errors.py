"""The errors exgrpo raises for things a user can fix; the CLI prints their message as one line (exit code 2)."""


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
