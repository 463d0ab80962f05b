"""Runtime plumbing: checkpoints, the run directory, atomic files, tracking, data parallelism, sharding, timing and
signals. Nothing here knows the algorithm."""

import os


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 without a launcher), before the process group exists. Here, not
    in `exgrpo.runtime.distributed`, so that the CLI reads it without importing torch."""
    return int(os.environ.get("RANK", "0"))
