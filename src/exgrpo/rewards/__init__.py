"""Verifiable rewards: answer graders, a process pool that bounds their time, and TRL-style reward functions."""

from exgrpo.rewards.functions import ChoiceReward, MathReward, ReasoningGymReward, combine_rewards
from exgrpo.rewards.graders import choice_letter, grade_choice, grade_math, grade_math_boxed, last_boxed
from exgrpo.rewards.pool import GradingPool

__all__ = ["grade_math", "grade_math_boxed", "grade_choice", "choice_letter", "last_boxed", "GradingPool",
           "MathReward", "ChoiceReward", "ReasoningGymReward", "combine_rewards"]
