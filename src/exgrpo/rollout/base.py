"""What every rollout engine is: the protocol, its sampling settings and its output.

The trainer talks to an engine through `RolloutEngine.generate`, which takes token ids and returns token ids (and,
for engines that report them, the log-probs of the sampled tokens). Engines: `hf` (transformers `generate` on the
training model itself, `exgrpo.rollout.hf`) and `vllm` (a vLLM engine holding a copy of the weights, pushed into it
after every update, `exgrpo.rollout.vllm`). Log-probs for the loss come from the training model's own forward
pass (as released); the engine's are used to check the sync and to correct for engine mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np



def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (e.g. run seed, step, group, member): one stream per request."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0]) >> 1


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @classmethod
    def from_config(cls, rollout, temperature: float | None = None) -> "SamplingSettings":
        """From the `rollout` config section (`temperature` in place of its own, e.g. eval.temperature)."""
        return cls(rollout.max_completion_length, rollout.temperature if temperature is None else temperature,
                   rollout.top_p, rollout.top_k)


@dataclass
class Rollouts:
    """Completions of N requests, one sequence each (repeat a prompt to sample it several times)."""

    completion_ids: list[list[int]]  # per sequence, up to and including EOS when it stopped
    truncated: list[bool]  # reached max_new_tokens without EOS
    logprobs: list[list[float]] | None = None  # the engine's log-prob of each sampled token, when it reports them


class RolloutEngine(Protocol):
    holds_copy: bool
    """True: the engine samples from a copy of the weights that `push_weights` reloads; False: it samples with the
    training model itself (under the learner's rollout weights: full, in the compute precision)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings,
                 seeds: Sequence[int]) -> Rollouts:
        """Sample one completion per prompt, the i-th from the random stream seeded by seeds[i].

        A request's sample depends on its own seed only, not on the rest of the batch, so sharding requests
        over data-parallel ranks or changing the generation batch size gives the same completions.
        """
        ...

    def push_weights(self, version: int) -> None:
        """Load the learner's current weights, now at `version` (applied optimizer steps), before returning. The
        rollout source calls it after every update that changed the weights and after a resume. An engine holding
        a copy reports the version it holds as `weights_version`, which the generation stage checks against the
        learner's. An engine whose `takes_snapshots` is True also takes `push_weights(version, weights)`, the
        weights a `copied_weights` snapshot (async mode under torchrun pushes so, from rank 0 alone)."""
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...
