"""The paper's evaluation protocol (spec §8): render, sample and grade a question set; avg@k and pass@k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from exgrpo.data import Question, render_prompt
from exgrpo.evaluation.estimators import benchmark_metrics
from exgrpo.evaluation.sampling import sample_completions
from exgrpo.rewards import GradingPool, after_think, choice_letter, grade_choice, grade_math, grade_math_boxed
from exgrpo.rewards.oat import oat_boxed_answer
from exgrpo.rollout import RolloutEngine, SamplingSettings

THINK = "<think>\n"

# --- protocol and grading ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalProtocol:
    """How prompts are rendered, sampled and graded. The defaults are the paper's (spec §8, §9.15)."""

    max_new_tokens: int = 8192
    temperature: float = 0.6
    top_p: float = 1.0
    remove_system: bool = True  # the eval script drops the parquet's system message
    system_prompt: str | None = None  # replaces the system messages (e.g. to match a training config)
    think_prefix: str = ""  # appended to prompts whose chat template does not already end with it
    think_gate: bool = False  # the training reward's gate (0 without "</think>"); the paper's eval does not enforce it
    last_box_only: bool = True  # the released grader on the last \boxed{}; otherwise math-verify on all the text

    def sampling(self) -> SamplingSettings:
        return SamplingSettings(self.max_new_tokens, self.temperature, self.top_p)


def grading_text(prompt: str, completion: str, protocol: EvalProtocol) -> str:
    """The text a grader sees, as the released eval script makes it (spec §8).

    A prompt ending with "<think>\\n" has it prepended to the completion, and only what follows the first
    "</think>" is graded (up to a second one); without a "</think>" the whole text is. A prompt that does not end
    with "<think>\\n" gives the completion as it is. With `think_gate` (the training reward's gate, not the
    paper's), a text without "</think>" gives "" whatever the prompt.
    """
    think_prompt = prompt.endswith(THINK)
    text = THINK + completion if think_prompt else completion
    solution = after_think(text)
    if protocol.think_gate:
        return "" if solution is None else solution
    return solution if think_prompt and solution is not None else text


def grader_for(kind: str, protocol: EvalProtocol) -> Callable[[str, str], float]:
    if kind == "choice":
        return grade_choice
    if kind == "math":
        return grade_math_boxed if protocol.last_box_only else grade_math
    raise ValueError(f"unknown grader kind {kind!r} (expected 'math' or 'choice')")


def extract_answer(text: str, kind: str) -> str:
    """What the grader grades in `text`: the chosen option for "choice", the last \\boxed{} content for "math" (as
    the released grader finds it: `oat_boxed_answer`).

    "" when there is none. (Without `last_box_only`, math-verify may also find an unboxed answer.)
    """
    if kind == "choice":
        return choice_letter(text)
    return oat_boxed_answer(text) or ""


# --- sampling and grading a question set -------------------------------------------------------------------------


@dataclass
class Sample:
    """One graded generation (a line of the generations JSONL)."""

    benchmark: str
    question_id: str
    sample: int
    completion: str
    answer: str  # extracted, see `extract_answer`
    gold: str
    grade: float
    truncated: bool  # stopped by max_new_tokens
    completion_tokens: int


@dataclass
class EvalResult:
    correct: np.ndarray  # (questions, samples) bool
    truncated: float  # fraction of samples stopped by max_new_tokens
    completion_tokens: float  # mean completion length

    def metrics(self) -> dict[str, float]:
        return {**benchmark_metrics(self.correct), "truncated": self.truncated,
                "completion_tokens": self.completion_tokens}


def evaluate_questions(engine: RolloutEngine, tokenizer, questions: Sequence[Question], *, name: str, kind: str,
                       samples: int, protocol: EvalProtocol, pool: GradingPool, seed: int = 0, batch_size: int = 64,
                       on_batch: Callable[[list[Sample]], None] | None = None) -> EvalResult:
    """Sample every question `samples` times under `protocol` and grade each sample with the `kind` grader.

    Sampling is `sample_completions` (longest prompts first, `batch_size` requests per engine call). `on_batch`
    receives each batch's graded `Sample`s as soon as they exist (progress, JSONL output). A sample is correct at
    grade 1.0.
    """
    if not questions or samples < 1:
        raise ValueError(f"{name}: need at least one question and one sample, got {len(questions)} and {samples}")
    grader = grader_for(kind, protocol)
    prompts = [render_prompt(tokenizer, q.messages, remove_system=protocol.remove_system,
                             system_prompt=protocol.system_prompt, think_prefix=protocol.think_prefix)
               for q in questions]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    correct = np.zeros((len(questions), samples), dtype=bool)
    truncated, tokens = 0, 0
    for out in sample_completions(engine, prompt_ids, samples, protocol.sampling(), seed, batch_size,
                                  longest_first=True):
        completions = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.completion_ids]
        texts = [grading_text(prompts[i], c, protocol) for (i, _), c in zip(out.requests, completions)]
        grades = pool.grade(grader, texts, [questions[i].answer for i, _ in out.requests])
        records = []
        for (i, s), completion, text, grade, ids, cut in zip(out.requests, completions, texts, grades,
                                                             out.completion_ids, out.truncated):
            correct[i, s] = grade >= 1.0
            truncated += cut
            tokens += len(ids)
            records.append(Sample(name, questions[i].id, s, completion, extract_answer(text, kind),
                                  questions[i].answer, grade, cut, len(ids)))
        if on_batch is not None:
            on_batch(records)
    n = len(questions) * samples
    return EvalResult(correct, truncated / n, tokens / n)
