"""Rollout engines: turn prompts into sampled completions.

The trainer talks to an engine through `RolloutEngine.generate`, which takes token ids and returns token ids, so
a vLLM engine can be added without touching the trainer. Log-probs for the loss come from the training model's
own forward pass (as released), not from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off


@dataclass
class Rollouts:
    """Completions of N requests, one sequence each (repeat a prompt to sample it several times)."""

    completion_ids: list[list[int]]  # per sequence, up to and including EOS when it stopped
    truncated: list[bool]  # reached max_new_tokens without EOS


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings, seed: int) -> Rollouts:
        """Sample one completion per prompt; reproducible for a given seed."""
        ...

    def sync_weights(self) -> None:
        """Called after every optimizer step (engines holding their own copy of the weights reload here)."""
        ...


class HFEngine:
    """Batched sampling with transformers' `generate` on the training model itself (left padding, stop at EOS)."""

    def __init__(self, model, tokenizer, batch_size: int = 256):
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token for batched generation")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

    def sync_weights(self) -> None:  # generates with the live training weights
        pass

    @torch.no_grad()
    def generate(self, prompt_ids, sampling: SamplingSettings, seed: int) -> Rollouts:
        torch.manual_seed(seed)
        completions: list[list[int]] = []
        truncated: list[bool] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompt_ids), self.batch_size):
                chunk = prompt_ids[start : start + self.batch_size]
                c, t = self._generate_chunk(chunk, sampling)
                completions += c
                truncated += t
        finally:
            self.model.train(was_training)
        return Rollouts(completions, truncated)

    def _generate_chunk(self, prompt_ids, sampling: SamplingSettings):
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        out = self.model.generate(
            input_ids=input_ids.to(self.model.device), attention_mask=attention.to(self.model.device),
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None,
            max_new_tokens=sampling.max_new_tokens, pad_token_id=pad, eos_token_id=sorted(self.eos_ids),
        )
        completions, truncated = [], []
        for row in out[:, width:].tolist():
            ids = []
            for token in row:
                ids.append(token)
                if token in self.eos_ids:
                    break
            stopped = bool(ids) and ids[-1] in self.eos_ids
            completions.append(ids)
            truncated.append(not stopped)
        return completions, truncated
