"""Reward functions with TRL's signature, f(prompts, completions, completion_ids, **dataset_columns), and their sum."""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any, Callable, Sequence

import numpy as np

from exgrpo.rewards.graders import grade_math
from exgrpo.rewards.task_graders import grade_choice, score_reasoning_gym
from exgrpo.rewards.pool import GradingPool

RewardFunc = Callable[..., list]


def _in_process(pool: GradingPool | None) -> GradingPool:
    """The given pool, or serial grading in this process without a timeout (math-verify's own apply)."""
    return pool if pool is not None else GradingPool(num_workers=0, timeout=None)


def grade_math_for_question(completion: str, task_json: str, think_gate: bool = False) -> float:
    """`grade_math` of a JSON-encoded [gold, question] pair, question given (picklable for the grading pool)."""
    gold, question = json.loads(task_json)
    return grade_math(completion, gold, think_gate=think_gate, question=question)


class MathReward:
    """Training reward (spec §6): math-verify against the `answer` column, 1.0 or 0.0, except that where the gold
    is a number the prompt corrects math-verify's reading (`grade_math` with `question`): an answer restating the
    prompt's arithmetic, or one the completion does not give as its answer, scores 0.0.

    The question's numbers are read from the prompt as the model saw it (chat template and system text included).
    """

    name = "math"

    def __init__(self, think_gate: bool = False, pool: GradingPool | None = None):
        self.think_gate = think_gate
        self.pool = _in_process(pool)

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list | None, *,
                 answer: list[str], **columns: Any) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"MathReward: {len(prompts)} prompts but {len(completions)} completions")
        for prompt in prompts:
            if not isinstance(prompt, str):
                raise TypeError(f"MathReward reads each question's numbers from its prompt, which must be text; "
                                f"got a {type(prompt).__name__}")
        tasks = [json.dumps([gold, prompt]) for gold, prompt in zip(answer, prompts)]
        return self.pool.grade(grade_math_for_question, completions, tasks, think_gate=self.think_gate)


class ChoiceReward:
    """Multiple-choice reward: the chosen letter (see `grade_choice`) against the `answer` column."""

    name = "choice"

    def __init__(self, pool: GradingPool | None = None):
        self.pool = _in_process(pool)

    def __call__(self, prompts: list, completions: list[str], completion_ids: list | None, *,
                 answer: list[str], **columns: Any) -> list[float]:
        return self.pool.grade(grade_choice, completions, answer)


def grade_reasoning_gym(completion: str, entry_json: str) -> float:
    """reasoning-gym's own scorer for the task of a JSON-encoded entry (picklable for the grading pool)."""
    return score_reasoning_gym(completion, json.loads(entry_json))


class ReasoningGymReward:
    """reasoning-gym's scorer against the `rg_entry` column of questions from a `reasoning_gym:` source.

    Some scorers give partial credit in [0, 1]; reward.success_threshold decides what counts as correct.
    """

    name = "reasoning_gym"

    def __init__(self, pool: GradingPool | None = None):
        self.pool = _in_process(pool)

    def __call__(self, prompts: list, completions: list[str], completion_ids: list | None = None, *,
                 rg_entry: list[dict] | None = None, **columns: Any) -> list[float]:
        if rg_entry is None or any(e is None for e in rg_entry):
            raise ValueError("reward.grader 'reasoning_gym' needs questions from a 'reasoning_gym:<task>' source")
        return self.pool.grade(grade_reasoning_gym, completions, [json.dumps(e) for e in rg_entry])


@functools.lru_cache(maxsize=None)
def import_function(spec: str) -> Callable:
    """The callable named by 'module:name'."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def call_reward_function(completion: str, item_json: str, function: str) -> float:
    """One completion through a user reward function (TRL's signature, one-item lists); None becomes NaN."""
    item = json.loads(item_json)
    columns = {k: [v] for k, v in item["columns"].items()}
    out = import_function(function)(prompts=[item["prompt"]], completions=[completion],
                                    completion_ids=[item["completion_ids"]], **columns)
    if not isinstance(out, (list, tuple, np.ndarray)) or len(out) != 1:
        raise ValueError(f"reward function {function!r} returned {out!r} for one completion")
    return float("nan") if out[0] is None else float(out[0])


class IsolatedReward:
    """A user reward function ('module:name') run like the built-in graders: one completion at a time in the
    grading pool, so a hang costs `reward.timeout` and a crash costs one item (both score 0 and are counted).

    The function is called with one-item lists, so a function that needs the whole batch at once must be passed
    to `ExGRPOTrainer` as a callable instead (it is then called once per batch, in-process, as TRL does).
    """

    def __init__(self, spec: str, pool: GradingPool):
        self.spec, self.pool = spec, pool
        self.name = spec.partition(":")[2]

    def __call__(self, prompts: list, completions: list[str], completion_ids: list, **columns: Any) -> list[float]:
        items = [json.dumps({"prompt": prompt, "completion_ids": list(ids),
                             "columns": {k: v[i] for k, v in columns.items()}}, default=str)
                 for i, (prompt, ids) in enumerate(zip(prompts, completion_ids))]
        return self.pool.grade(call_reward_function, list(completions), items, label=self.spec, function=self.spec)


def combine_rewards(funcs: Sequence[RewardFunc], weights: Sequence[float], prompts: list, completions: list,
                    completion_ids: list, columns: dict[str, list]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Weighted sum of reward functions, as TRL computes it: None means "no opinion" and is skipped (nansum).

    Returns the total (N,) and each function's rewards (N,) by name, with None as NaN.
    """
    if len(weights) != len(funcs):
        raise ValueError(f"{len(funcs)} reward functions but {len(weights)} weights")
    n = len(completions)
    per_func: dict[str, np.ndarray] = {}
    for f in funcs:
        name = getattr(f, "name", None) or f.__name__
        if name in per_func:
            raise ValueError(f"two reward functions are named {name!r}")
        out = f(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        if not isinstance(out, (list, tuple, np.ndarray)) or len(out) != n:
            got = f"{len(out)} rewards" if isinstance(out, (list, tuple, np.ndarray)) else type(out).__name__
            raise ValueError(f"reward function {name!r} returned {got} for {n} completions")
        per_func[name] = np.array([np.nan if r is None else r for r in out], dtype=np.float64)
    stacked = np.stack(list(per_func.values())) if per_func else np.zeros((0, n))
    total = np.nansum(stacked * np.asarray(weights, dtype=np.float64)[:, None], axis=0)
    return total, per_func


def score_completions(funcs: Sequence[RewardFunc], weights: Sequence[float], prompts: list, completions: list,
                      completion_ids: list, questions: Sequence, truncated: Sequence[bool] = (),
                      truncated_reward: float | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`combine_rewards` with TRL's dataset columns: each completion's question gives `answer` plus its `columns`.

    `questions` holds one question per completion (objects with `.answer` and a `.columns` dict, e.g.
    `exgrpo.data.Question`); a column some questions lack is None for them. Given `truncated_reward`
    (reward.truncated fail), the completions flagged in `truncated` total that instead, their grades kept.
    """
    keys = sorted({k for q in questions for k in q.columns} - {"answer"})
    columns = {"answer": [q.answer for q in questions], **{k: [q.columns.get(k) for q in questions] for k in keys}}
    total, per_function = combine_rewards(funcs, weights, prompts, completions, completion_ids, columns)
    if truncated_reward is not None:
        total[np.asarray(truncated, dtype=bool)] = truncated_reward
    return total, per_function
