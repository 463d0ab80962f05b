"""Runtime plumbing: checkpoints, the run directory, atomic files, tracking, data parallelism, sharding, timing and
signals. Nothing here knows the algorithm."""
