"""Which stored trajectory of a question is replayed (spec §3, §9.1).

The trainer scores every stored candidate with the current policy (a batched no-grad forward pass) as the
selection metric says, and the mode picks among a question's scores. The default is the lowest *mean* token
entropy. The released code effectively ranks by a sum of entropies (a masking bug, spec §9.1); "entropy_sum"
reproduces that ranking for ablations.
"""

from __future__ import annotations

from typing import Callable

import torch

from exgrpo.config.schema import SelectionMetric, SelectionMode
from exgrpo.tensors import TrajectoryScore

#: experience.selection_metric: how each candidate is scored under the current policy; None: a uniform draw,
#: nothing scored
SELECTION_METRICS: dict[SelectionMetric, TrajectoryScore | None] = {
    "entropy": TrajectoryScore(uses_entropy=True, reduce=lambda total, count: total / count),  # mean entropy
    "entropy_sum": TrajectoryScore(uses_entropy=True, reduce=lambda total, count: total),  # the released ranking
    "perplexity": TrajectoryScore(uses_entropy=False, reduce=lambda total, count: torch.exp(-total / count)),
    "random": None,
}

#: experience.selection_mode: a question's (n,) candidate scores -> the index of the one replayed
SELECTION_MODES: dict[SelectionMode, Callable[[torch.Tensor], torch.Tensor]] = {
    "argmin": torch.argmin,
    "argmax": torch.argmax,
}
