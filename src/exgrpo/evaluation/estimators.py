"""avg@k and unbiased pass@k: pure functions of a (questions, samples) boolean correctness matrix."""

from __future__ import annotations

import numpy as np


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
