"""Wiring a config into parts: model, questions, reward functions, trainer."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from exgrpo.config import ConfigError, ExGRPOConfig
from exgrpo.data import load_questions, split_holdout
from exgrpo.models import LoraSettings, load_policy
from exgrpo.rewards import ChoiceReward, GradingPool, MathReward, ReasoningGymReward
from exgrpo.trainer import ExGRPOTrainer


@dataclass
class Run:
    config: ExGRPOConfig
    trainer: ExGRPOTrainer
    grading_pool: GradingPool

    def close(self) -> None:
        self.grading_pool.close()


def build_reward_funcs(config: ExGRPOConfig, pool: GradingPool) -> list:
    r = config.reward
    if r.function:
        module, _, name = r.function.partition(":")
        try:
            return [getattr(importlib.import_module(module), name)]
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"reward.function: cannot import {r.function!r} (expected 'module:name'): {e}") from None
    if r.grader == "math":
        return [MathReward(think_gate=r.think_gate, pool=pool)]
    if r.grader == "choice":
        return [ChoiceReward(pool=pool)]
    return [ReasoningGymReward(pool=pool)]


def build_run(config: ExGRPOConfig) -> Run:
    c = config
    torch.manual_seed(c.train.seed)
    if c.train.threads:
        torch.set_num_threads(c.train.threads)
    questions = load_questions(c.data.train, split=c.data.split, limit=c.data.limit, skip_invalid=c.data.skip_invalid,
                               prompt_suffix=c.data.prompt_suffix)
    train, holdout = split_holdout(questions, c.data.holdout, c.train.seed) if c.data.holdout else (list(questions), [])
    if c.data.eval:
        holdout = list(load_questions(c.data.eval, skip_invalid=c.data.skip_invalid,
                                      prompt_suffix=c.data.prompt_suffix))
    lora = LoraSettings(c.model.lora.r, c.model.lora.alpha, c.model.lora.dropout, c.model.lora.target_modules) \
        if c.model.lora else None
    model, tokenizer = load_policy(c.model.name, dtype=c.model.dtype, lora=lora)
    pool = GradingPool(num_workers=c.reward.workers, timeout=c.reward.timeout)
    reward_funcs = build_reward_funcs(c, pool)
    trainer = ExGRPOTrainer(model, tokenizer, reward_funcs, c, train, eval_dataset=holdout)
    out = Path(c.logging.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c.to_dict(), indent=2))
    return Run(c, trainer, pool)
