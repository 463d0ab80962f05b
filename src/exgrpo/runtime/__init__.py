"""Runtime plumbing: checkpoints, the run directory, atomic files, tracking, data parallelism, sharding, timing and
signals. Nothing here knows the algorithm."""

import os

from exgrpo.errors import ExgrpoError


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 without a launcher), before the process group exists. Here, not
    in `exgrpo.runtime.distributed`, so that the CLI reads it without importing torch."""
    value = os.environ.get("RANK", "0")
    try:
        return int(value)
    except ValueError:  # the CLI's first question: one line, not a traceback
        raise ExgrpoError(f"the environment variable RANK is {value!r}, not a process rank (torchrun sets it to 0, "
                          "1, ...); unset it to run one process") from None
