"""The `hf` rollout engine: transformers `generate` on the training model itself, with exact per-row sampling."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from exgrpo.rollout.base import Rollouts, SamplingSettings, check_requests, eos_token_ids
from exgrpo.rollout.weights import base_model
from exgrpo.tensors import distinct_rows


class PerRowSampler(LogitsProcessor):
    """Exact sampling from softmax(logits / T) restricted by top-k / top-p, one random stream per row.

    Gumbel-max: argmax(log p + G) with G ~ Gumbel(0, 1) is a sample from p. Drawing G from a per-row generator
    makes each row's sample independent of which other rows share its batch.
    """

    def __init__(self, sampling: SamplingSettings, seeds: Sequence[int]):
        self.sampling = sampling
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        logits = scores.float() / s.temperature
        if s.top_k and s.top_k < logits.shape[-1]:
            kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) > s.top_p  # keep the token that crosses top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        uniform = torch.stack([torch.rand(logits.shape[-1], generator=g) for g in self.generators]).to(logits.device)
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-10, 1 - 1e-7)))
        return torch.log_softmax(logits, dim=-1) + gumbel


class HFEngine:
    """Batched sampling with transformers' `generate` on the training model itself (left padding, stop at EOS)."""

    holds_copy = reports_logprobs = False

    def __init__(self, model, tokenizer, batch_size: int = 256):
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token for batched generation")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.eos_ids = set(eos_token_ids(tokenizer))

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_ids, sampling: SamplingSettings, seeds: Sequence[int]) -> Rollouts:
        check_requests(prompt_ids, sampling, seeds)
        completions: list[list[int]] = []
        truncated: list[bool] = []
        was_training = self.model.training
        self.model.eval()
        # A fresh generation config for the call: the model's own (repetition_penalty, no_repeat_ngram_size,
        # min_new_tokens, suppress_tokens, ...) would reshape the distribution before PerRowSampler sees it, and
        # the recorded behaviour log-probs would not be those of the distribution actually sampled. transformers
        # fills unset fields of a passed config from the model's, so the model's is swapped out instead.
        inner = base_model(self.model)
        own, inner.generation_config = inner.generation_config, GenerationConfig()
        try:
            for start in range(0, len(prompt_ids), self.batch_size):
                end = start + self.batch_size
                c, t = self._generate_chunk(prompt_ids[start:end], sampling, seeds[start:end])
                completions += c
                truncated += t
        finally:
            inner.generation_config = own
            self.model.train(was_training)
        return Rollouts(completions, truncated)

    def shared_prefill(self, input_ids: torch.Tensor, attention: torch.Tensor):
        """The KV cache of all but the last prompt token, computed once per distinct prompt (a group's K rows
        repeat one), or None when every row's prompt differs and generate's own prefill is as cheap."""
        first, owner = distinct_rows(torch.cat([input_ids, attention], dim=1))
        if len(first) == len(input_ids) or input_ids.shape[1] < 2:
            return None
        ids, mask = input_ids[first, :-1], attention[first, :-1]
        cache = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                           use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_select_indices(owner)
        return cache

    def _generate_chunk(self, prompt_ids, sampling: SamplingSettings, seeds):
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        input_ids, attention = input_ids.to(self.model.device), attention.to(self.model.device)
        # Sampling happens in the logits processor (Gumbel-max with a generator per row), so generate decodes
        # greedily over already-sampled scores.
        config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=False, pad_token_id=pad,
                                  eos_token_id=sorted(self.eos_ids))
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention, past_key_values=self.shared_prefill(input_ids, attention),
            generation_config=config, logits_processor=LogitsProcessorList([PerRowSampler(sampling, seeds)]),
            synced_gpus=False)  # under FSDP the trainer gathers the weights first: no collectives while decoding
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
