"""Evaluation: the paper's benchmarks and protocol (`exgrpo eval`) and held-out accuracy during training.

* `benchmarks`: the registry of the paper's benchmarks and their loaders;
* `protocol`: render, sample and grade a question set under the paper's protocol (spec §8);
* `estimators`: avg@k and unbiased pass@k;
* `heldout`: held-out accuracy graded by the training reward functions (the trainer's `eval.every`, the demo);
* `sampling`: the sampling core both share (per-request seeds);
* `run`: the `exgrpo eval` command (outputs, the paper's table).
"""

from exgrpo.evaluation.estimators import avg_at_k, benchmark_metrics, mean_pass_at_k, pass_at_k, report_ks
from exgrpo.evaluation.heldout import Accuracy, evaluate_accuracy
from exgrpo.evaluation.protocol import (THINK, EvalProtocol, EvalResult, Sample, evaluate_questions, extract_answer,
                                        grader_for, grading_text)

__all__ = ["THINK", "Accuracy", "EvalProtocol", "EvalResult", "Sample", "avg_at_k", "benchmark_metrics",
           "evaluate_accuracy", "evaluate_questions", "extract_answer", "grader_for", "grading_text",
           "mean_pass_at_k", "pass_at_k", "report_ks"]
