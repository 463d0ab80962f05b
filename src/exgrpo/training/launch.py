"""Wiring a config into parts: model, questions, reward functions, trainer."""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers.utils import logging as transformers_logging

from exgrpo.runtime.checkpoint import checkpoint_step, latest_intact_checkpoint, read_trainer_json, step_dirs
from exgrpo.config import ConfigError, ExGRPOConfig, config_changes
from exgrpo.config.rules import ASYNC_ACROSS_RANKS_NEEDS_SERVERS, ASYNC_NEEDS_ITS_OWN_ENGINE
from exgrpo.data import conflicting_answers, distinct_prompts, load_questions, split_holdout
from exgrpo.runtime import launched_rank
from exgrpo.runtime.distributed import close_distributed
from exgrpo.runtime.provenance import read_sessions
from exgrpo.errors import CheckpointError, ExgrpoWarning, Shutdown
from exgrpo.evaluation.contamination import screen_benchmark_questions
from exgrpo.models import load_policy
from exgrpo.rewards import ChoiceReward, GradingPool, IsolatedReward, MathReward, ReasoningGymReward
from exgrpo.rewards.functions import import_function
from exgrpo.rollout import require_engine
from exgrpo.runtime.rundir import (checkpoints_gone, holds_a_run, lock_run_directory, refuse_existing_run,
                                   unlock_run_directory)
from exgrpo.training.trainer import ExGRPOTrainer


@dataclass
class Run:
    config: ExGRPOConfig
    trainer: ExGRPOTrainer
    grading_pool: GradingPool

    def close(self) -> None:
        self.trainer.close()
        self.grading_pool.close()


def build_reward_funcs(config: ExGRPOConfig, pool: GradingPool) -> list:
    r = config.reward
    if r.function:
        try:
            import_function(r.function)  # fail here, not in a grading worker
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"reward.function: cannot import {r.function!r} (expected 'module:name'): {e}") from None
        return [IsolatedReward(r.function, pool)]
    if r.grader == "math":
        return [MathReward(think_gate=r.think_gate, pool=pool)]
    if r.grader == "choice":
        return [ChoiceReward(pool=pool)]
    return [ReasoningGymReward(pool=pool)]


def build_run(config: ExGRPOConfig, log: Callable[[str], None] = print) -> Run:
    """Load the questions (benchmark questions screened before the model loads; what was read is logged), the
    model and the rewards."""
    c = config
    torch.manual_seed(c.train.seed)
    questions = load_questions(c.data.train, split=c.data.split, limit=c.data.limit, skip_invalid=c.data.skip_invalid,
                               prompt_suffix=c.data.prompt_suffix)
    log(_loaded("data.train", c.data.train, questions))
    questions = screen_benchmark_questions(questions, c.data.benchmark_overlap, f"data.train {c.data.train}",
                                           c.data.prompt_suffix)
    _warn_conflicting_answers(f"data.train {c.data.train}", questions)
    train, holdout = _held_out_split(questions, c)
    if c.data.eval:
        holdout = load_questions(c.data.eval, skip_invalid=c.data.skip_invalid, prompt_suffix=c.data.prompt_suffix)
        log(_loaded("data.eval", c.data.eval, holdout))
        holdout = screen_benchmark_questions(holdout, c.data.benchmark_overlap, f"data.eval {c.data.eval}",
                                             c.data.prompt_suffix)
    _refuse_async_without_its_engine(c)
    require_engine(c.rollout.engine)  # before the model loads
    if not c.logging.progress:  # nor transformers' bars (loading weights, writing checkpoint shards)
        transformers_logging.disable_progress_bar()
    model, tokenizer = load_policy(c.model.name, dtype=c.model.dtype, lora=c.model.lora)
    pool = GradingPool(num_workers=c.reward.workers, timeout=c.reward.timeout)
    reward_funcs = build_reward_funcs(c, pool)
    trainer = ExGRPOTrainer(model, tokenizer, reward_funcs, c, train, eval_dataset=holdout, grading_pool=pool)
    return Run(c, trainer, pool)


def _held_out_split(questions, c: ExGRPOConfig) -> tuple[list, list]:
    """(training, held-out) questions: data.holdout distinct prompts held out, at least one left to train on."""
    if not c.data.holdout:
        return list(questions), []
    prompts = distinct_prompts(questions)
    if c.data.holdout >= prompts:
        raise ConfigError(f"data.holdout ({c.data.holdout}) must be less than the {prompts} distinct prompts of "
                          f"data.train {c.data.train}, so that some are left to train on (all rows of a prompt go to "
                          "one side)")
    return split_holdout(questions, c.data.holdout, c.train.seed)


def _refuse_async_without_its_engine(config: ExGRPOConfig) -> None:
    """The trainer's refusals of rollout.mode async (which a library caller passing its own engine meets there),
    made before the model loads for a run built from its config."""
    if config.rollout.mode != "async":
        return
    if config.rollout.engine == "hf":
        raise ConfigError(ASYNC_NEEDS_ITS_OWN_ENGINE)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and config.rollout.engine != "servers":
        raise ConfigError(ASYNC_ACROSS_RANKS_NEEDS_SERVERS)


def _warn_conflicting_answers(source: str, questions) -> None:
    conflicts = conflicting_answers(questions)
    if conflicts:
        rows = conflicts[0]
        warnings.warn(ExgrpoWarning(
            f"{source}: {len(conflicts)} prompts appear with different answers (e.g. {rows[0].id} and {rows[1].id}: "
            f"{rows[0].answer!r} vs {rows[1].answer!r}); they are kept, and all rows of a prompt stay on one side of "
            "the held-out split"), stacklevel=2)


def _loaded(field: str, source: str, questions) -> str:
    files = f" from {questions.files} file{'s' * (questions.files != 1)}" if questions.files else ""
    skipped = f" ({questions.skipped} invalid rows skipped)" if questions.skipped else ""
    return f"{field} {source}: {len(questions)} questions{files}{skipped}"


def start_point(config: ExGRPOConfig, resume: bool, log: Callable[[str], None] = print,
                start_over: str = "--overwrite") -> tuple[ExGRPOConfig, Path | None]:
    """Decide where the run starts: (config to run, checkpoint to resume from or None).

    Fresh (`resume` false): the directory must not hold another run unless logging.overwrite. Resume: the newest
    intact checkpoint (broken newer ones are reported); none at all but a run that died before its first
    checkpoint: start it again from step 0; only broken ones, or a history past a checkpoint that is gone: an
    error. A config that changes the algorithm relative to the checkpoint's is refused with the differing fields;
    harmless changes are logged. `start_over` is how the command that resumes starts a run over, for its errors.
    """
    directory = config.logging.output_dir
    main = launched_rank() == 0  # under data parallelism rank 0 owns the directory; the others only read it
    if not resume:
        if main and not config.logging.overwrite:
            refuse_existing_run(directory)
        return config, None
    if config.logging.overwrite:
        raise ConfigError("--resume and logging.overwrite (--overwrite) contradict each other")
    if main:
        read_sessions(directory)  # a damaged provenance.json is refused now, not once the model has loaded
    checkpoint = latest_intact_checkpoint(directory)
    if checkpoint is None:
        return _start_again(config, directory, main, log, start_over), None
    if config.train.steps < checkpoint_step(checkpoint):  # it would train nothing and store the smaller number
        raise ConfigError(f"cannot resume {checkpoint} with train.steps {config.train.steps}: the run is at step "
                          f"{checkpoint_step(checkpoint)} already (train.steps is the run's length, not the steps to "
                          "add)")
    try:
        algorithmic, harmless = config_changes(read_trainer_json(checkpoint)["config"], config.to_dict())
    except ConfigError as e:  # the stored config's own problem (a renamed field set under both names)
        raise ConfigError(f"{checkpoint / 'trainer.json'}: config: {e}") from None
    if algorithmic:
        raise ConfigError(f"cannot resume {checkpoint} with a config that changes the algorithm: "
                          f"{'; '.join(algorithmic)} (start a new run in another logging.output_dir instead)")
    if harmless and main:
        log(f"resuming with changed settings: {'; '.join(harmless)}")
    return config, checkpoint


def _start_again(config: ExGRPOConfig, directory: str, main: bool, log: Callable[[str], None],
                 start_over: str) -> ExGRPOConfig:
    """Resume without an intact checkpoint: an error when there were checkpoints (broken or removed ones), a fresh
    start replacing the partial logs of a run that stopped before its first checkpoint."""
    if step_dirs(directory):
        raise CheckpointError(f"{directory}: no intact checkpoint to resume from (see the warnings above); "
                              f"restore one, or start over with {start_over}")
    if not holds_a_run(directory):
        return config
    gone = checkpoints_gone(directory)
    if gone:
        raise CheckpointError(f"{directory}: {gone}; resuming would start over and replace that history. Restore a "
                              f"checkpoint, or start over with {start_over}, which deletes the run")
    if main:
        log(f"{directory}: the run stopped before its first checkpoint; starting it again from step 0")
    return replace(config, logging=replace(config.logging, overwrite=True))


@contextlib.contextmanager
def prepared_run(config: ExGRPOConfig, resume: bool, log: Callable[[str], None] = print,
                 start_over: str = "--overwrite") -> Iterator[tuple[Run, Path | None]]:
    """Lock the run directory, then `start_point` and `build_run`: (the run, the checkpoint to resume from or None).
    The directory stays locked until the block ends, then the engine and grading pool are closed and the lock
    released. Under data parallelism rank 0 owns the directory."""
    with Shutdown() as cleanup:
        cleanup.callback(close_distributed)  # last: the run's own closing may still talk to the other ranks
        if launched_rank() == 0:
            lock_run_directory(config.logging.output_dir)
            cleanup.callback(unlock_run_directory, config.logging.output_dir)
        config, checkpoint = start_point(config, resume, log, start_over)
        run = build_run(config, log)
        cleanup.callback(run.close)
        yield run, checkpoint
