"""Questions and prompts: loading (files, HF datasets, reasoning-gym), chat rendering, the held-out split and the
fresh-question pool."""

from exgrpo.data.pool import QuestionPool
from exgrpo.data.prompts import PromptEncoder, drop_long_prompts, render_prompt
from exgrpo.data.questions import (RG_PREFIX, DataError, Question, QuestionSet, load_questions,
                                   parse_reasoning_gym_source)
from exgrpo.data.splits import collapse_replicas, conflicting_answers, distinct_prompts, split_holdout

__all__ = ["DataError", "PromptEncoder", "drop_long_prompts", "Question", "QuestionPool", "QuestionSet", "RG_PREFIX",
           "collapse_replicas", "conflicting_answers", "distinct_prompts", "load_questions",
           "parse_reasoning_gym_source", "render_prompt", "split_holdout"]
