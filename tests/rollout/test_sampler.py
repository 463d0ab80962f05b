"""The hf engine's per-row Gumbel-max sampler draws from softmax(logits / T) restricted by top-k / top-p."""

import numpy as np
import pytest
import torch

from exgrpo.rollout import PerRowSampler, SamplingSettings

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}  # the 0.999 quantile of chi-square by degrees of freedom


def _draw(sampling: SamplingSettings, n: int = 20000) -> np.ndarray:
    scores = LOGITS.repeat(n, 1)
    out = PerRowSampler(sampling, seeds=range(n))(torch.zeros(n, 1, dtype=torch.long), scores)
    return np.bincount(out.argmax(-1).numpy(), minlength=len(LOGITS))


def _expected(temperature: float, keep: list[int]) -> np.ndarray:
    p = torch.softmax(LOGITS / temperature, -1).numpy()
    masked = np.zeros_like(p)
    masked[keep] = p[keep]
    return masked / masked.sum()


@pytest.mark.parametrize("sampling, keep", [
    (SamplingSettings(8, temperature=1.0), [0, 1, 2, 3, 4]),
    (SamplingSettings(8, temperature=0.7), [0, 1, 2, 3, 4]),
    (SamplingSettings(8, temperature=1.0, top_k=3), [0, 1, 2]),
    # p = .56 .21 .13 .08 .03: top_p keeps the tokens until the cumulative mass crosses it, the crossing one included
    (SamplingSettings(8, temperature=1.0, top_p=0.8), [0, 1, 2]),
    (SamplingSettings(8, temperature=1.0, top_p=0.5), [0]),
], ids=["T1", "T0.7", "top_k3", "top_p0.8", "top_p0.5"])
def test_samples_follow_the_restricted_distribution(sampling, keep):
    counts = _draw(sampling)
    expected = _expected(sampling.temperature, keep) * counts.sum()
    assert counts[[i for i in range(len(LOGITS)) if i not in keep]].sum() == 0  # masked tokens never drawn
    if len(keep) == 1:
        return
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2 < CHI2_999[len(keep) - 1], (counts, expected.round())


def test_a_rows_sample_depends_on_its_seed_only():
    sampling = SamplingSettings(8)
    scores = LOGITS.repeat(6, 1)
    together = PerRowSampler(sampling, [5, 6, 7, 8, 9, 10])(torch.zeros(6, 1, dtype=torch.long), scores)
    alone = PerRowSampler(sampling, [7])(torch.zeros(1, 1, dtype=torch.long), LOGITS.unsqueeze(0))
    assert torch.equal(together[2], alone[0])
