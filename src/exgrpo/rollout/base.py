"""What every rollout engine is: two roles, their sampling settings and their output.

* `RolloutEngine`, the sampling role: token ids in, token ids out (and, where `reports_logprobs`, the engine's
  log-prob of every sampled token). Engines: `hf` (transformers `generate` on the training model itself,
  `exgrpo.rollout.hf`), `vllm` (a vLLM engine with its own copy of the weights, `exgrpo.rollout.vllm`) and
  `servers` (`vllm serve` servers, `exgrpo.rollout.servers`).
* `WeightReceiver`, the role of an engine with its own copy: a push of a weights version, confirmed before it
  returns (`exgrpo.rollout.push`).

Log-probs for the loss come from the training model's own forward pass (as released); the engine's are used to
check the sync and to correct for engine mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from exgrpo.errors import EngineError


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


Weights = list  # [(checkpoint name, tensor)]: a copy of the learner's pushed weights (`copied_weights`)


class RolloutEngine(Protocol):
    """The sampling role: what every engine is."""

    holds_copy: bool
    """True: the engine samples from a copy of the weights, which reaches it through the `WeightReceiver` role
    (its own, or that of the engine it samples through); False: it samples with the training model itself (under
    the learner's rollout weights: full, in the compute precision)."""

    reports_logprobs: bool
    """True: `Rollouts.logprobs` holds the engine's log-prob of every sampled token."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings,
                 seeds: Sequence[int]) -> Rollouts:
        """Sample one completion per prompt, the i-th from the random stream seeded by seeds[i].

        A request's sample depends on its own seed only, not on the rest of the batch, so sharding requests
        over data-parallel ranks or changing the generation batch size gives the same completions.
        """
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """The weight-receiving role of an engine holding its own copy of the weights (`holds_copy`)."""

    weights_version: int
    """The version (applied optimizer steps) of the weights it holds: the version its rollouts come from."""

    takes_snapshots: bool
    """True: `push_weights` also takes a snapshot of the weights to send instead of reading the learner's (async
    mode under torchrun, where rank 0's worker pushes what every rank helped gather)."""

    def push_weights(self, version: int, snapshot: Weights | None = None) -> None:
        """Load the learner's current weights (or `snapshot`), now at `version`, and confirm the engine holds them
        (every parameter loaded, `version` read back) before returning. The rollout source calls it after every
        update that changed the weights and after a resume."""
        ...


class CopyHoldingEngine(RolloutEngine, WeightReceiver, Protocol):
    """An engine with both roles (`vllm`, `servers`)."""


def weight_receiver(engine: RolloutEngine) -> WeightReceiver | None:
    """The engine in its weight-receiving role, or None where it takes no pushes: it samples with the training
    model (`hf`), or it samples through another engine that receives them (`RolloutWorker`'s)."""
    if isinstance(engine, WeightReceiver):
        return engine
    if hasattr(engine, "push_weights"):  # short of the rest of the role: never pushed to, it would sample stale weights
        missing = [name for name in ("weights_version", "takes_snapshots") if not hasattr(engine, name)]
        raise EngineError(f"{type(engine).__name__} has push_weights but no {' or '.join(missing)}: an engine that "
                          "receives the learner's weights needs weights_version, takes_snapshots and push_weights "
                          "(exgrpo.rollout.base.WeightReceiver)")
    return None


def eos_token_ids(tokenizer) -> list[int]:
    """The token ids that end a completion (a tokenizer's eos_token_id may be one id or a list)."""
    eos = tokenizer.eos_token_id
    return sorted(set(eos if isinstance(eos, list) else [eos]))


def check_requests(prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings, seeds: Sequence[int],
                   max_model_len: int | None = None, engine: str = "the engine") -> None:
    """One seed per prompt, and (given `max_model_len`, that of `engine`) room for every prompt and its new
    tokens."""
    if len(seeds) != len(prompt_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(seeds)} seeds")
    too_long = [len(p) for p in prompt_ids if max_model_len and len(p) + sampling.max_new_tokens > max_model_len]
    if too_long:
        raise EngineError(f"a prompt of {too_long[0]} tokens + {sampling.max_new_tokens} new tokens exceeds "
                          f"{engine}'s max_model_len {max_model_len} (rollout.max_model_len)")


def vllm_sampling(sampling: SamplingSettings, seed: int, eos_ids: Sequence[int]) -> dict:
    """vLLM's sampling parameters of one request (as `SamplingParams` keywords and as a server's JSON): one
    completion, its token ids and the log-prob of each sampled token, no text."""
    return dict(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
                max_tokens=sampling.max_new_tokens, seed=int(seed), logprobs=0, detokenize=False,
                stop_token_ids=list(eos_ids))
