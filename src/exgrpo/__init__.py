"""ExGRPO: experience replay for RL from verifiable rewards (Zhan et al., 2025)."""

__version__ = "0.1.0"
