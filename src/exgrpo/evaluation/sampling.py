"""The core both evaluations share: sample every prompt k times with per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from exgrpo.rollout import RolloutEngine, SamplingSettings, derive_seed


@dataclass
class SampledBatch:
    requests: list[tuple[int, int]]  # (prompt index, sample index)
    completion_ids: list[list[int]]
    truncated: list[bool]


def sample_completions(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], samples: int,
                       sampling: SamplingSettings, seed: int, batch_size: int | None = None,
                       longest_first: bool = False) -> Iterator[SampledBatch]:
    """Sample each prompt `samples` times, in engine calls of `batch_size` requests (None: one call).

    Sample s of prompt i is drawn with seed `derive_seed(seed, i, s)`, so results do not depend on the batch
    size or order. `longest_first` orders the requests by decreasing prompt length, so that each batch holds
    similar lengths and wastes little compute on left padding.
    """
    requests = [(i, s) for i in range(len(prompt_ids)) for s in range(samples)]
    if longest_first:
        requests.sort(key=lambda r: -len(prompt_ids[r[0]]))
    size = batch_size or max(len(requests), 1)
    for start in range(0, len(requests), size):
        batch = requests[start : start + size]
        out = engine.generate([prompt_ids[i] for i, _ in batch], sampling, [derive_seed(seed, i, s) for i, s in batch])
        yield SampledBatch(batch, out.completion_ids, out.truncated)
