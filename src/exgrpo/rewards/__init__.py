"""Verifiable rewards: answer graders, a process pool that bounds their time, and TRL-style reward functions."""

from exgrpo.rewards.functions import ChoiceReward, MathReward, ReasoningGymReward, combine_rewards
from exgrpo.rewards.graders import grade_choice, grade_math
from exgrpo.rewards.pool import GradingPool

__all__ = ["grade_math", "grade_choice", "GradingPool", "MathReward", "ChoiceReward", "ReasoningGymReward",
           "combine_rewards"]
