"""Verifiable rewards: answer graders, a process pool that bounds their time, and TRL-style reward functions."""

from exgrpo.rewards.functions import (ChoiceReward, IsolatedReward, MathReward, ReasoningGymReward, combine_rewards,
                                      score_completions)
from exgrpo.rewards.graders import after_think, grade_math
from exgrpo.rewards.oat import grade_math_boxed, grade_oat, oat_boxed_answer
from exgrpo.rewards.pool import GradingPool
from exgrpo.rewards.restatement import is_restatement
from exgrpo.rewards.task_graders import (choice_letter, extract_final_answer, grade_choice, last_boxed,
                                          score_reasoning_gym)

__all__ = ["grade_math", "grade_math_boxed", "grade_oat", "oat_boxed_answer", "is_restatement", "grade_choice",
           "choice_letter", "last_boxed", "after_think", "extract_final_answer", "score_reasoning_gym", "GradingPool",
           "MathReward", "ChoiceReward", "ReasoningGymReward", "IsolatedReward", "combine_rewards", "score_completions"]
