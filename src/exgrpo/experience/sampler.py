"""Which experiential questions a batch replays (spec §3).

Each non-empty correctness bucket k gets a weight (default: a Gaussian over k centred on K/2 with sigma in
success-count units), normalised over the non-empty buckets only: a per-bucket probability, so a question in a
small bucket is drawn more often. Counts per bucket ~ Multinomial(n, p); draws beyond a bucket's size move, one
at a time, to buckets with room (probability proportional to the original p); inside a bucket questions are drawn
uniformly without replacement, so a batch never holds a question twice.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from exgrpo.config.schema import BucketScheme


def _normal(ks: list[int], K: int, mu: float, sigma: float) -> list[float]:
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    return [math.exp(-((k - mu) ** 2) / (2 * sigma**2)) for k in ks]


#: The per-bucket weights of the bucket schemes, (buckets k, K, mu, sigma) -> one weight per k: normal
#: exp(-(k-mu)^2 / (2 sigma^2)); linear k/K; sqrt sqrt(k/K); linear_clip k/K for k <= K/2, else 0.5.
BUCKET_WEIGHTS: dict[BucketScheme, Callable[[list[int], int, float, float], list[float]]] = {
    "normal": _normal,
    "linear": lambda ks, K, mu, sigma: [k / K for k in ks],
    "sqrt": lambda ks, K, mu, sigma: [math.sqrt(k / K) for k in ks],
    "linear_clip": lambda ks, K, mu, sigma: [k / K if k <= K / 2 else 0.5 for k in ks],
}


def bucket_probabilities(
    buckets: Iterable[int], num_generations: int = 8, scheme: BucketScheme = "normal", sigma: float = 1.0,
    mean: float | None = None,
) -> dict[int, float]:
    """Probability of each given non-empty bucket k (a success count in 1..K-1) under a scheme of `BUCKET_WEIGHTS`,
    with mu = K/2 unless `mean` is given. ("uniform" is over questions, not buckets: see `QUESTION_DRAWS`.)"""
    weigh = BUCKET_WEIGHTS[scheme]
    ks = sorted(set(int(k) for k in buckets))
    if not ks:
        return {}
    K = num_generations
    weights = weigh(ks, K, K / 2 if mean is None else mean, sigma)
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"bucket weights for buckets {ks} under scheme {scheme!r} sum to zero")
    return {k: w / total for k, w in zip(ks, weights)}


def num_experiential(available: int, batch_size: int, ratio: float) -> int:
    """n_exp = min(available, floor(B * ratio))."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"experience ratio must be in [0, 1], got {ratio}")
    return min(available, math.floor(batch_size * ratio + 1e-9))


def bucket_counts(
    sizes: Mapping[int, int], probabilities: Mapping[int, float], n: int, rng: np.random.Generator
) -> dict[int, int]:
    """Draw per-bucket counts ~ Multinomial(n, p), moving overflow to buckets with room one draw at a time."""
    ks = sorted(probabilities)
    if n > sum(sizes[k] for k in ks):
        raise ValueError(f"cannot draw {n} questions from buckets holding {sum(sizes[k] for k in ks)}")
    p = np.array([probabilities[k] for k in ks], dtype=np.float64)
    counts = dict(zip(ks, rng.multinomial(n, p / p.sum()).tolist()))
    excess = 0
    for k in ks:
        if counts[k] > sizes[k]:
            excess += counts[k] - sizes[k]
            counts[k] = sizes[k]
    for _ in range(excess):
        room = [i for i, k in enumerate(ks) if counts[k] < sizes[k]]
        weights = p[room]
        # A bucket whose p underflowed to 0 can still take overflow when nothing else has room.
        weights = weights / weights.sum() if weights.sum() > 0 else np.full(len(room), 1 / len(room))
        counts[ks[room[rng.choice(len(room), p=weights)]]] += 1
    return counts


def _draw_by_buckets(scheme: str, buckets: Mapping[int, Sequence[str]], n: int, rng: np.random.Generator,
                     num_generations: int, sigma: float, mean: float | None) -> list[str]:
    """Per-bucket counts by the scheme's bucket probabilities, then uniformly inside each bucket."""
    probabilities = bucket_probabilities(buckets, num_generations, scheme, sigma, mean)
    counts = bucket_counts({k: len(ids) for k, ids in buckets.items()}, probabilities, n, rng)
    chosen: list[str] = []
    for k in sorted(counts):
        if counts[k]:
            ids = buckets[k]
            chosen.extend(ids[i] for i in _sample_without_replacement(len(ids), counts[k], rng))
    return chosen


def _draw_uniformly(buckets: Mapping[int, Sequence[str]], n: int, rng: np.random.Generator,
                    num_generations: int, sigma: float, mean: float | None) -> list[str]:
    """Uniformly over the questions, whatever their bucket."""
    pool = [qid for k in sorted(buckets) for qid in buckets[k]]
    return [pool[i] for i in _sample_without_replacement(len(pool), n, rng)]


#: experience.bucket_scheme: (non-empty buckets, n <= their questions, rng, K, sigma, mean) -> n distinct ids
QUESTION_DRAWS: dict[BucketScheme, Callable[..., list[str]]] = {
    **{scheme: functools.partial(_draw_by_buckets, scheme) for scheme in BUCKET_WEIGHTS},
    "uniform": _draw_uniformly,
}


def sample_questions(
    buckets: Mapping[int, Sequence[str]], n: int, rng: np.random.Generator,
    num_generations: int = 8, scheme: BucketScheme = "normal", sigma: float = 1.0, mean: float | None = None,
) -> list[str]:
    """Draw min(n, available) distinct question ids from the non-empty buckets (k -> ids) by `scheme`."""
    draw = QUESTION_DRAWS[scheme]
    buckets = {k: ids for k, ids in buckets.items() if len(ids)}
    n = min(n, sum(len(ids) for ids in buckets.values()))
    if n <= 0:
        return []
    return draw(buckets, n, rng, num_generations, sigma, mean)


def _sample_without_replacement(population: int, n: int, rng: np.random.Generator) -> list[int]:
    """n distinct indices in [0, population); O(n) for small n (Floyd's algorithm), so huge buckets stay cheap."""
    if n * 4 >= population:
        return rng.permutation(population)[:n].tolist()
    chosen: dict[int, None] = {}
    for j in range(population - n, population):
        t = int(rng.integers(0, j + 1))
        chosen[j if t in chosen else t] = None
    return list(chosen)
