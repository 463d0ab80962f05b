"""Wall time per stage of a training step."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class StageTimer:
    """`with timer("rollout"): ...` adds the block's wall time to stage "rollout"; a stage timed twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """`time/<stage>` for every stage timed, in the order first timed."""
        return {f"time/{stage}": s for stage, s in self.seconds.items()}
