"""Evaluation: the paper's protocol (spec §8) — sample, grade, avg@k and unbiased pass@k — and held-out accuracy.

`evaluate_questions` samples and grades one question set under an `EvalProtocol`; `heldout_metrics` is the hook a
trainer calls every N steps; `evaluate_accuracy` is the demo's before/after measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from exgrpo.benchmarks import TEST_DATA_SOURCES
from exgrpo.data import Question, collapse_replicas, render_prompt
from exgrpo.rewards import (GradingPool, choice_letter, combine_rewards, grade_choice, grade_math, grade_math_boxed,
                            last_boxed)
from exgrpo.rollout import RolloutEngine, SamplingSettings, derive_seed

THINK = "<think>\n"

# --- metrics: pure functions of a (questions, samples) boolean correctness matrix --------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms the (huge) binomial coefficients.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def avg_at_k(correct: np.ndarray) -> float:
    """Mean correctness over all samples (every question has the same number k of samples)."""
    return float(np.mean(correct))


def mean_pass_at_k(correct: np.ndarray, k: int) -> float:
    """pass@k averaged over questions."""
    n = correct.shape[1]
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)]))


def report_ks(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n."""
    return [2**i for i in range(n.bit_length()) if 2**i < n] + [n]


def benchmark_metrics(correct: np.ndarray) -> dict[str, float]:
    """``avg@n`` and ``pass@k`` for k in `report_ks(n)`, for n samples per question."""
    n = correct.shape[1]
    return {f"avg@{n}": avg_at_k(correct), **{f"pass@{k}": mean_pass_at_k(correct, k) for k in report_ks(n)}}


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
    think_gate: bool = False  # the training reward's gate; the paper's eval does not enforce it
    last_box_only: bool = True  # the OAT grader: only the last \boxed{} counts; otherwise math-verify on all text

    def sampling(self) -> SamplingSettings:
        return SamplingSettings(self.max_new_tokens, self.temperature, self.top_p)


def grading_text(prompt: str, completion: str, protocol: EvalProtocol) -> str:
    """The text a grader sees: a prompt ending with "<think>\\n" has it prepended to the completion, as the eval
    script does; with `think_gate`, only what follows the first "</think>" ("" if there is none)."""
    text = THINK + completion if prompt.endswith(THINK) else completion
    if protocol.think_gate:
        return text.split("</think>")[1] if "</think>" in text else ""
    return text


def grader_for(kind: str, protocol: EvalProtocol) -> Callable[[str, str], float]:
    if kind == "choice":
        return grade_choice
    if kind == "math":
        return grade_math_boxed if protocol.last_box_only else grade_math
    raise ValueError(f"unknown grader kind {kind!r} (expected 'math' or 'choice')")


def extract_answer(text: str, kind: str) -> str:
    """What the grader grades in `text`: the chosen option for "choice", the last \\boxed{} content for "math".

    "" when there is none. (Without `last_box_only`, math-verify may also find an unboxed answer.)
    """
    if kind == "choice":
        return choice_letter(text)
    return last_boxed(text) or ""


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

    Sample s of question i is drawn with seed `derive_seed(seed, i, s)`, so results do not depend on the batch
    size. Generation runs in batches of `batch_size` requests; `on_batch` receives each batch's graded `Sample`s
    as soon as they exist (progress, JSONL output). A sample is correct at grade 1.0.
    """
    if not questions or samples < 1:
        raise ValueError(f"{name}: need at least one question and one sample, got {len(questions)} and {samples}")
    grader = grader_for(kind, protocol)
    prompts = [render_prompt(tokenizer, q.messages, remove_system=protocol.remove_system,
                             system_prompt=protocol.system_prompt, think_prefix=protocol.think_prefix)
               for q in questions]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    # Longest prompts first, so each batch holds similar lengths and wastes little compute on left padding.
    requests = sorted(((i, s) for i in range(len(questions)) for s in range(samples)),
                      key=lambda r: -len(prompt_ids[r[0]]))
    correct = np.zeros((len(questions), samples), dtype=bool)
    truncated, tokens = 0, 0
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        out = engine.generate([prompt_ids[i] for i, _ in batch], protocol.sampling(),
                              [derive_seed(seed, i, s) for i, s in batch])
        completions = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.completion_ids]
        texts = [grading_text(prompts[i], c, protocol) for (i, _), c in zip(batch, completions)]
        grades = pool.grade(grader, texts, [questions[i].answer for i, _ in batch])
        records = []
        for (i, s), completion, text, grade, ids, cut in zip(batch, completions, texts, grades, out.completion_ids,
                                                             out.truncated):
            correct[i, s] = grade >= 1.0
            truncated += cut
            tokens += len(ids)
            records.append(Sample(name, questions[i].id, s, completion, extract_answer(text, kind),
                                  questions[i].answer, grade, cut, len(ids)))
        if on_batch is not None:
            on_batch(records)
    return EvalResult(correct, truncated / len(requests), tokens / len(requests))


def heldout_metrics(engine: RolloutEngine, tokenizer, sets: Mapping[str, Sequence[Question]], pool: GradingPool,
                    protocol: EvalProtocol, *, samples: int = 1, kind: str = "math", seed: int = 0,
                    batch_size: int = 64, allow_test_set: bool = False) -> dict[str, float]:
    """In-training evaluation hook: metrics of each held-out set, for a tracker, named ``eval/<set>/<metric>``.

    Metrics: ``avg@<samples>``, ``pass@k`` (k in `report_ks`), ``truncated`` and ``completion_tokens``.
    Replicated rows are collapsed; every distinct question gets `samples` samples. Questions whose
    ``data_source`` is a registered benchmark's are refused unless `allow_test_set`: ``valid.parquet`` holds the
    test questions, so selecting checkpoints on it leaks the test set (spec §9.16).
    """
    metrics: dict[str, float] = {}
    for set_name, questions in sets.items():
        leaked = sorted({q.columns.get("data_source") for q in questions} & TEST_DATA_SOURCES)
        if leaked and not allow_test_set:
            raise ValueError(f"held-out set {set_name!r} contains benchmark test questions (data_source "
                             f"{', '.join(leaked)}); use a disjoint set, or pass allow_test_set=True (spec §9.16)")
        distinct = [q for q, _ in collapse_replicas(questions)]
        result = evaluate_questions(engine, tokenizer, distinct, name=set_name, kind=kind, samples=samples,
                                    protocol=protocol, pool=pool, seed=seed, batch_size=batch_size)
        metrics.update({f"eval/{set_name}/{k}": v for k, v in result.metrics().items()})
    return metrics


# --- held-out accuracy for the demo ------------------------------------------------------------------------------


@dataclass
class Accuracy:
    mean: float  # mean correctness over all samples (avg@k)
    stderr: float  # standard error over questions (samples of one question are not independent)
    num_questions: int
    samples_per_question: int
    per_question: list[float]

    def __str__(self) -> str:
        return f"{100 * self.mean:.1f}% ± {100 * self.stderr:.1f} (n={self.num_questions}×{self.samples_per_question})"


def evaluate_accuracy(engine: RolloutEngine, tokenizer, questions: Sequence[Question], reward_funcs: Sequence[Callable],
                      sampling: SamplingSettings, samples: int, seed: int, success_threshold: float = 1.0,
                      prompt_ids_of: Callable[[Question], list[int]] | None = None) -> Accuracy:
    """avg@samples, graded by the reward functions, with its standard error over questions."""
    if not questions:
        raise ValueError("no held-out questions to evaluate")
    prompt_ids_of = prompt_ids_of or (
        lambda q: tokenizer(render_prompt(tokenizer, q.messages), add_special_tokens=False)["input_ids"])
    prompt_ids = [prompt_ids_of(q) for q in questions]
    requests = [(i, s) for i in range(len(questions)) for s in range(samples)]
    seeds = [derive_seed(seed, i, s) for i, s in requests]
    out = engine.generate([prompt_ids[i] for i, _ in requests], sampling, seeds)
    completions = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.completion_ids]
    keys = sorted({k for q in questions for k in q.columns} - {"answer"})
    columns = {"answer": [questions[i].answer for i, _ in requests],
               **{k: [questions[i].columns.get(k) for i, _ in requests] for k in keys}}
    prompts = [tokenizer.decode(prompt_ids[i]) for i, _ in requests]
    weights = [1.0] * len(reward_funcs)
    total, _ = combine_rewards(reward_funcs, weights, prompts, completions, out.completion_ids, columns)
    correct = (total >= success_threshold).reshape(len(questions), samples).astype(float)
    per_question = correct.mean(axis=1)
    n = len(questions)
    stderr = float(per_question.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return Accuracy(float(per_question.mean()), stderr, n, samples, per_question.tolist())
