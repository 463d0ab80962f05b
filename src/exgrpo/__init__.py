"""ExGRPO: experience replay for RL from verifiable rewards (Zhan et al., 2025).

What a TRL user imports: `from exgrpo import ExGRPOTrainer, ExGRPOConfig, load_config`, plus the parts of the
README's Python example (`load_policy`, `load_questions`, the reward functions). Names are resolved on first use,
so `import exgrpo` (and the CLI) stays light until a heavy part is needed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ExGRPOTrainer": "exgrpo.training.trainer",
    "ExGRPOConfig": "exgrpo.config",
    "load_config": "exgrpo.config",
    "ConfigError": "exgrpo.config",
    "Question": "exgrpo.data",
    "load_questions": "exgrpo.data",
    "load_policy": "exgrpo.models",
    "MathReward": "exgrpo.rewards",
    "ChoiceReward": "exgrpo.rewards",
    "ReasoningGymReward": "exgrpo.rewards",
    "GradingPool": "exgrpo.rewards",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'exgrpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
