"""The typed configuration of a run: one YAML file, dotted command-line overrides, errors that name the field.

Names follow TRL where they overlap (num_generations, max_completion_length, temperature, epsilon, beta,
learning_rate, scale_rewards); defaults follow the released ExGRPO run script (spec §7) unless a comment says why.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from exgrpo.errors import ExgrpoError


class ConfigError(ExgrpoError, ValueError):
    """A config file or override that cannot be honoured; the message names the field."""


@dataclass
class LoraConfig:
    r: int = 32
    """Rank of the LoRA update B·A."""
    alpha: int = 64
    """LoRA scaling numerator: the update is (alpha / r)·B·A."""
    dropout: float = 0.0
    """Dropout on the LoRA branch's input during training (never during rollouts or log-prob passes)."""
    target_modules: str = "all-linear"
    """Modules that get adapters: peft's "all-linear", or a comma list of module names (e.g. "q_proj,v_proj")."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """HF hub id, local directory, or a built-in preset: smollm2-135m-instruct, tiny, tiny:<seed>."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are loaded in."""
    lora: LoraConfig | None = None
    """LoRA adapters (peft) instead of full fine-tuning; null for full fine-tuning."""


@dataclass
class DataConfig:
    train: str = "reasoning_gym:basic_arithmetic?size=500&seed=1"
    """Training questions: parquet/jsonl file or directory, HF dataset name, or reasoning_gym:<task>?options."""
    split: str = "train"
    """Split of a Hugging Face dataset (`train` or `eval` given as a dataset name)."""
    limit: int | None = None
    """Keep only the first N valid training questions; null keeps all."""
    holdout: int = 0
    """Questions taken out of `train` (disjoint by content) for held-out evaluation."""
    eval: str | None = None
    """A separate held-out set (same formats as `train`); never the benchmark test set by default (spec §9.16)."""
    prompt_suffix: str = ""
    """Appended to the last user message of every question (e.g. an answer-format instruction)."""
    remove_system: bool = False
    """Drop the data's system messages before applying the chat template."""
    system_prompt: str | None = None
    """Replace the data's system messages with this one; null keeps them."""
    think_prefix: str = ""
    """Appended to every rendered prompt unless the chat template already ends with it (released: "<think>\\n")."""
    skip_invalid: bool = False
    """Skip (and count) dataset rows with a missing or ill-typed field instead of failing on the first one."""
    max_prompt_length: int | None = None
    """Drop (and count) questions whose rendered prompt has more tokens than this (released: 1024); null keeps
    all."""
    benchmark_overlap: Literal["refuse", "drop", "allow"] = "refuse"
    """Training or held-out questions whose text is a benchmark test question (by content): refuse the data, drop
    them (and count them), or allow them (a deliberate contamination study)."""


@dataclass
class RolloutConfig:
    engine: Literal["hf", "vllm"] = "hf"
    """Rollout engine: hf (transformers generate on the training model) or vllm (an in-process vLLM engine with its
    own copy of the weights, synced after every optimizer step; needs the vllm extra)."""
    engine_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """vllm: the engine's precision; auto is the trainer's compute precision (bfloat16 under train.dtype bf16)."""
    max_model_len: int | None = None
    """vllm: prompt + completion tokens per sequence; null: data.max_prompt_length (else the longest prompt in the
    data) + max_completion_length."""
    gpu_memory_utilization: float = 0.5
    """vllm on CUDA: the share of GPU memory the colocated engine may take (weights and KV cache)."""
    kv_cache_gb: float | None = None
    """vllm on CPU: KV-cache memory in GiB; null: room for generation_batch_size full-length sequences."""
    sync_timeout: float = 120.0
    """vllm: seconds a weight push may take before the run stops with an error."""
    parity_every: int = 1
    """vllm: every N steps compare the engine's sampling log-probs with the trainer's on the same tokens (logged
    as rollout/logp_diff_*); 0 never."""
    parity_threshold: float | None = None
    """vllm: stop when the mean absolute log-prob difference exceeds this (the engine is not running the
    trainer's weights); null: 0.05 nats, or 0.1 when the engine's precision differs from the trainer's."""
    num_generations: int = 8
    """K: the group size, rollouts per question (an experiential question's replay is one of them)."""
    max_completion_length: int = 8192
    """Maximum new tokens per rollout; a rollout stopped here has no EOS and counts as truncated."""
    temperature: float = 1.0
    """Sampling temperature; log-probs for the loss are those of this distribution."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1 disables it."""
    top_k: int = 0
    """0 disables top-k."""
    generation_batch_size: int = 256
    """Sequences per generate call (memory bound)."""
    zero_variance: Literal["keep", "backfill", "replace_from_buffer"] = "keep"
    """Groups whose K rewards are all equal (no gradient): keep them with A = 0 (released); backfill: drop them and
    roll out further fresh questions until B informative groups or max_generation_rounds (DAPO's dynamic
    sampling); replace_from_buffer: in the mixed phase refill their slots with experiential questions (fresh
    ones once the buffer has no unused question; in the warm-up it backfills)."""
    max_generation_rounds: int = 3
    """backfill, replace_from_buffer: rounds of generation per step at most (the first included)."""


@dataclass
class RewardConfig:
    grader: Literal["math", "choice", "reasoning_gym"] = "math"
    """Built-in reward: math (math-verify against the answer), choice (option letter), reasoning_gym (the task's
    own scorer)."""
    function: str | None = None
    """A reward function 'module:name' (TRL's signature) used instead of the grader."""
    think_gate: bool = False
    """Answer = text after the first </think>; missing </think> scores 0 (released training reward: true)."""
    workers: int = 2
    """Grading processes; 0 grades in the training process."""
    timeout: float = 5.0
    """Seconds a grading worker may spend on one completion before it scores 0 (and the worker is replaced)."""
    success_threshold: float = 1.0
    """A rollout counts as correct (for k, buckets, retirement, Pass@1) when its reward >= this."""
    min_value: float = 0.0
    """The range every reward function's values are expected in (the built-in graders: [0, 1]); values outside it
    are warned about, naming the function."""
    max_value: float = 1.0
    """Upper end of that range; success_threshold must lie in (min_value, max_value]."""


@dataclass
class ObjectiveConfig:
    scale_rewards: Literal["none", "group"] = "none"
    """Advantages: none = R - group mean (released); group = (R - mean) / (group std + 1e-4)."""
    epsilon_low: float = 0.2
    """PPO clip below: fresh tokens' ratio is clipped at 1 - epsilon_low while clipping is on."""
    epsilon_high: float = 0.2
    """PPO clip above: at 1 + epsilon_high."""
    clip_after_switch: bool = False
    """PPO-clip fresh tokens in the mixed phase too (released: unclipped after the switch)."""
    beta: float = 0.1
    """Policy-shaping constant of f(w) = w / (w + beta) for replayed tokens."""
    policy_shaping: bool = True
    """False replays with the plain importance ratio w (ablation)."""
    aggregation: Literal["sum_constant", "token_mean", "seq_mean_token_mean"] = "sum_constant"
    """Token losses to a scalar: sum / normalizer (released), mean over the mini-batch's tokens, or mean over
    sequences of per-sequence token means."""
    normalizer: float | None = None
    """Constant of sum_constant aggregation; null means max_completion_length (released)."""
    entropy_coef: float = 0.001
    """Weight of the entropy bonus: minus this times the token-mean entropy of each mini-batch."""
    engine_correction: Literal["auto", "none", "tis"] = "auto"
    """Correct for an engine that samples from a slightly different distribution than the trainer computes
    (another precision or kernels): tis weights each fresh token's loss by min(pi_trainer_old / pi_engine, tis_cap)
    (truncated importance sampling); auto is tis when the vllm engine's precision differs from the trainer's."""
    tis_cap: float = 2.0
    """The truncation C of the tis weight."""
    loss_scale: Literal["global", "per_rank"] = "global"
    """global: the update equals one process's over the whole mini-batch, whatever the number of ranks.
    per_rank: the released code's scale (spec §4.3): each rank's loss over its own share, gradients averaged
    over ranks (so sum_constant's normalizer is effectively times the ranks), the entropy bonus over each
    micro-batch and summed."""


@dataclass
class ExperienceConfig:
    ratio: float = 0.5
    """Fraction of each batch's questions drawn from the buffer; 0 gives plain GRPO."""
    policy: Literal["exgrpo", "rlep", "prioritized", "prompt_replay"] = "exgrpo"
    """The replay policy (docs/replay.md): exgrpo (buckets + one replayed trajectory per experiential group), rlep
    (every fresh question with stored successes replays one; no experiential questions), prioritized (re-ask
    questions with priority p(1-p), all members fresh), prompt_replay (re-ask bucket-sampled questions, all
    members fresh)."""
    retest_every: int = 10
    """prioritized: every N-th step re-asks questions whose success rate is 0 or 1 (priority 0) instead."""
    start_threshold: float = 0.35
    """Switch to the mixed phase once batch Pass@1 > this (strict)."""
    bucket_scheme: Literal["normal", "linear", "sqrt", "linear_clip", "uniform"] = "normal"
    """Per-bucket weights over success counts k: normal (a Gaussian), linear k/K, sqrt, linear_clip, or uniform
    over questions (no buckets)."""
    bucket_sigma: float = 1.0
    """Standard deviation of the normal scheme, in success counts (released: 1)."""
    bucket_mean: float | None = None
    """Centre of the normal scheme in success counts; null means K/2."""
    selection_metric: Literal["entropy", "entropy_sum", "perplexity", "random"] = "entropy"
    """What ranks a question's stored trajectories: mean token entropy under the current policy, its sum (the
    released ranking, spec §9.1), perplexity, or a uniform draw."""
    selection_mode: Literal["argmin", "argmax"] = "argmin"
    """Replay the lowest- or highest-scoring trajectory."""
    importance_correction: bool = True
    """Replay ratio against the recorded behaviour log-probs (released exp_is_correct)."""
    lbound: int = 0
    """Collect a group with k correct members only when lbound < k (released: 0)."""
    rbound: int | None = None
    """... and k <= rbound; null means K - 1."""
    max_trajectories_per_question: int | None = None
    """Keep only a question's newest N trajectories; null keeps all (released: unbounded)."""
    max_questions: int | None = None
    """Hold at most N questions, evicting the least recently updated; null is unbounded (released)."""
    selection_batch_size: int = 32
    """Candidates per no-grad scoring forward."""


@dataclass
class GuidanceConfig:
    field: str | None = None
    """External guidance (LUFFY, arXiv 2504.14945; docs/replay.md): the dataset column holding reference
    solutions (a string or a list of strings per row; missing or empty: none for that question); null: off."""
    members: int = 1
    """Demonstrations per group at most (the other members are fresh rollouts); 1 .. num_generations - 1."""
    mode: Literal["always", "fallback"] = "always"
    """always: every fresh group of a question with demonstrations gets them, from step 0 (LUFFY); fallback: only
    while the policy has not solved the question itself (no correct rollout of its own yet in this run)."""
    gamma: float = 0.1
    """Shaping of demonstration tokens: the loss weighs them by f(pi) = pi / (pi + gamma), pi the current policy's
    probability of the token (their behaviour probability is unknown)."""


@dataclass
class TrainConfig:
    steps: int = 700
    """Training steps (each: one batch of prompts_per_step questions, mini_batches optimizer steps)."""
    prompts_per_step: int = 128
    """B: questions per step (experiential + fresh)."""
    mini_batches: int = 2
    """Optimizer steps per training step (released: 2 mini-batches of 64 questions)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (at most); gradients accumulate over a mini-batch."""
    max_tokens_per_micro_batch: int | None = None
    """Also cap each micro-batch at this many padded tokens (rows x (prompt + completion) width), packing rows by
    length (like verl's dynamic batch size: 32768 per GPU in the released run); null caps rows only."""
    logprob_chunk_tokens: int | None = None
    """Compute the output head, log-softmax and entropy this many completion tokens at a time (recomputed in
    backward), so (tokens x vocabulary) logits never exist at once; null computes them in one go."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute precision: bf16 runs forward and backward in bfloat16 over fp32 master weights and optimizer
    state (log-probs, ratios and the loss stay fp32); needs model.dtype float32."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (transformers' gradient checkpointing) instead of
    storing them."""
    sharding: Literal["ddp", "fsdp"] = "ddp"
    """Data parallelism: ddp replicates the model on every rank; fsdp shards parameters, gradients and optimizer
    state with FSDP2 (per decoder layer). One process: no effect."""
    learning_rate: float = 1e-6
    """AdamW learning rate (peak, for schedules with warm-up or decay)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """transformers scheduler over steps * mini_batches optimizer steps."""
    warmup_steps: int = 0
    """Linear warm-up, in optimizer steps."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this."""
    skip_grad_norm: float = 500.0
    """Skip the update when the grad norm is non-finite or above this (.inf: never skip a finite one)."""
    max_skipped_updates: int = 5
    """Stop with an error once more optimizer steps than this have been skipped in the run."""
    seed: int = 47
    """Seeds the data order, batch composition, rollouts and held-out sampling."""
    save_every: int = 50
    """Checkpoint every N steps (and at the end, and on SIGINT/SIGTERM); 0 checkpoints only at the end."""
    save_total_limit: int = 2
    """Keep the newest N checkpoints."""
    threads: int = 0
    """torch CPU threads; 0 leaves torch's default."""
    check_replicas: bool = False
    """Data parallel: after every step compare the ranks' buffer and parameter hashes, fail on a mismatch."""


@dataclass
class EvalConfig:
    every: int = 0
    """Held-out evaluation every N steps and after the last step (0: only where the command asks, e.g.
    before/after in the demo)."""
    samples: int = 4
    """Samples per held-out question (the metric is avg@samples)."""
    temperature: float = 1.0
    """Sampling temperature of the held-out evaluation."""
    max_questions: int | None = None
    """Evaluate only the first N held-out questions; null evaluates all."""


@dataclass
class LoggingConfig:
    output_dir: str = "runs/exgrpo"
    """The run directory: config.json, metrics.jsonl, samples.jsonl, tensorboard/ and checkpoints/."""
    overwrite: bool = False
    """Start a fresh run even if output_dir holds another run's files (they are deleted); without it that is an
    error (continue a run with `exgrpo train --resume`)."""
    tensorboard: bool = True
    """Write TensorBoard scalars under output_dir/tensorboard."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""
    sample_every: int = 10
    """Log example completions every N steps (0: never)."""
    progress: bool = True
    """Show a progress bar on stderr."""


@dataclass
class ExGRPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy: which model, its dtype, LoRA."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out questions and how prompts are rendered."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling: the engine, K, lengths, temperature."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The verifiable reward and what counts as correct."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """Advantages and the mixed-policy loss."""
    experience: ExperienceConfig = field(default_factory=ExperienceConfig)
    """Experience management: delayed start, buckets, replay selection, buffer bounds."""
    guidance: GuidanceConfig = field(default_factory=GuidanceConfig)
    """External guidance: reference solutions from the data as off-policy group members."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batching, optimizer, schedule, seeds, checkpoints."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic held-out evaluation."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """The run directory and where metrics go."""

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def validate(cfg: ExGRPOConfig) -> None:
    """Every value and every combination, before anything is loaded; the error names the field and what it needs."""
    _check_finite(cfg, "")
    for ok, message in _rules(cfg):
        if not ok:
            raise ConfigError(message)


_MAY_BE_INFINITE = {"train.skip_grad_norm"}


def _check_finite(node, prefix: str) -> None:
    for f in dataclasses.fields(node):
        value, where = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, where + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            if not (value == math.inf and where in _MAY_BE_INFINITE):
                raise ConfigError(f"{where} must be a finite number (got {value})")


def _rules(cfg: ExGRPOConfig):
    """(condition, message) pairs, in field order; the first false one is reported."""
    for section in (_model_and_data_rules, _rollout_rules, _reward_and_objective_rules, _experience_rules,
                    _guidance_rules, _train_eval_and_logging_rules):
        yield from section(cfg)


def _at_least(where: str, value, low) -> tuple[bool, str]:
    return value >= low, f"{where} must be >= {low} (got {value})"


def _positive(where: str, value) -> tuple[bool, str]:
    return value > 0, f"{where} must be > 0 (got {value})"


def _optional_at_least(where: str, value, low) -> tuple[bool, str]:
    return value is None or value >= low, f"{where} must be null or >= {low} (got {value})"


def _text(where: str, value) -> tuple[bool, str]:
    return bool(value and value.strip()), f"{where} must be a non-empty string"


def _model_and_data_rules(cfg: ExGRPOConfig):
    """model.*, data.*"""
    m, d = cfg.model, cfg.data
    lora = m.lora
    yield _text("model.name", m.name)
    if lora is not None:
        yield _at_least("model.lora.r", lora.r, 1)
        yield _positive("model.lora.alpha", lora.alpha)
        yield 0 <= lora.dropout < 1, f"model.lora.dropout must be in [0, 1) (got {lora.dropout})"
        yield _text("model.lora.target_modules", lora.target_modules)
    yield _text("data.train", d.train)
    yield _text("data.split", d.split)
    yield _optional_at_least("data.limit", d.limit, 1)
    yield _at_least("data.holdout", d.holdout, 0)
    yield d.eval is None or bool(d.eval.strip()), "data.eval must be null or a non-empty string"


def _rollout_rules(cfg: ExGRPOConfig):
    """rollout.* (and the engine's interplay with objective and experience)"""
    ro, o, e = cfg.rollout, cfg.objective, cfg.experience
    K = cfg.rollout.num_generations
    yield _at_least("rollout.num_generations", K, 2)
    yield _at_least("rollout.max_completion_length", ro.max_completion_length, 1)
    yield ro.temperature > 0, f"rollout.temperature must be > 0 (got {ro.temperature}; GRPO groups need sampling)"
    yield 0 < ro.top_p <= 1, f"rollout.top_p must be in (0, 1] (got {ro.top_p})"
    yield _at_least("rollout.top_k", ro.top_k, 0)
    yield _at_least("rollout.generation_batch_size", ro.generation_batch_size, 1)
    yield _optional_at_least("rollout.max_model_len", ro.max_model_len, 2)
    yield 0 < ro.gpu_memory_utilization <= 1, \
        f"rollout.gpu_memory_utilization must be in (0, 1] (got {ro.gpu_memory_utilization})"
    yield ro.kv_cache_gb is None or ro.kv_cache_gb > 0, \
        f"rollout.kv_cache_gb must be null or > 0 (got {ro.kv_cache_gb})"
    yield _positive("rollout.sync_timeout", ro.sync_timeout)
    yield _at_least("rollout.parity_every", ro.parity_every, 0)
    yield ro.parity_threshold is None or ro.parity_threshold > 0, \
        f"rollout.parity_threshold must be null or > 0 (got {ro.parity_threshold})"
    yield ro.engine == "hf" or (ro.top_p == 1 and ro.top_k == 0), \
        ("rollout.engine vllm reports log-probs renormalised over the top-p/top-k set, which the trainer does not "
         "use: it needs rollout.top_p 1 and rollout.top_k 0")
    yield ro.engine == "vllm" or (ro.engine_dtype == "auto" and ro.max_model_len is None and ro.kv_cache_gb is None
                                  and o.engine_correction == "auto"), \
        ("rollout.engine_dtype, max_model_len, kv_cache_gb and objective.engine_correction apply to rollout.engine "
         "vllm only")
    yield not (o.engine_correction == "none" and engine_precision(cfg) != compute_precision(cfg)), \
        (f"the vllm engine samples in {engine_precision(cfg)} but the trainer computes in {compute_precision(cfg)}: "
         "its log-probs differ, so objective.engine_correction must not be none (use tis or auto)")
    yield o.tis_cap >= 1, f"objective.tis_cap must be >= 1 (got {o.tis_cap})"
    yield _at_least("rollout.max_generation_rounds", ro.max_generation_rounds, 1)
    yield ro.zero_variance != "keep" or ro.max_generation_rounds == 3, \
        "rollout.max_generation_rounds applies to rollout.zero_variance backfill or replace_from_buffer only"
    yield ro.zero_variance != "replace_from_buffer" or e.ratio > 0, \
        "rollout.zero_variance replace_from_buffer needs a buffer: experience.ratio must be > 0"


def _reward_and_objective_rules(cfg: ExGRPOConfig):
    """reward.*, objective.*"""
    rw, o = cfg.reward, cfg.objective
    yield _at_least("reward.workers", rw.workers, 0)
    yield _positive("reward.timeout", rw.timeout)
    yield rw.min_value < rw.max_value, \
        f"reward.min_value ({rw.min_value}) must be < reward.max_value ({rw.max_value})"
    yield rw.min_value < rw.success_threshold <= rw.max_value, \
        (f"reward.success_threshold ({rw.success_threshold}) must lie in (reward.min_value, reward.max_value] = "
         f"({rw.min_value}, {rw.max_value}]: otherwise every rollout, or none, counts as correct")
    yield rw.function is None or (rw.function.count(":") == 1 and all(rw.function.split(":"))), \
        f"reward.function must look like 'module:name' (got {rw.function!r})"
    yield not rw.think_gate or (rw.grader == "math" and rw.function is None), \
        "reward.think_gate applies to the math grader only (reward.grader: math, no reward.function)"
    yield 0 <= o.epsilon_low < 1, f"objective.epsilon_low must be in [0, 1) (got {o.epsilon_low})"
    yield _at_least("objective.epsilon_high", o.epsilon_high, 0)
    yield _positive("objective.beta", o.beta)
    yield o.normalizer is None or o.normalizer > 0, f"objective.normalizer must be null or > 0 (got {o.normalizer})"
    yield o.normalizer is None or o.aggregation == "sum_constant", \
        f"objective.normalizer is used by aggregation sum_constant only (aggregation is {o.aggregation!r})"


def _experience_rules(cfg: ExGRPOConfig):
    """experience.*"""
    e = cfg.experience
    K, B = cfg.rollout.num_generations, cfg.train.prompts_per_step
    rbound = K - 1 if e.rbound is None else e.rbound
    yield 0 <= e.ratio <= 1, f"experience.ratio must be in [0, 1] (got {e.ratio})"
    yield e.ratio == 0 or math.floor(B * e.ratio + 1e-9) >= 1, \
        (f"experience.ratio ({e.ratio}) x train.prompts_per_step ({B}) < 1: no batch could hold an experiential "
         "question (use ratio 0 for GRPO)")
    yield 0 <= e.start_threshold < 1, f"experience.start_threshold must be in [0, 1) (got {e.start_threshold})"
    yield _positive("experience.bucket_sigma", e.bucket_sigma)
    yield e.bucket_mean is None or 1 <= e.bucket_mean <= K - 1, \
        f"experience.bucket_mean must be null or in [1, num_generations-1 = {K - 1}] (got {e.bucket_mean})"
    yield e.bucket_scheme == "normal" or (e.bucket_mean is None and e.bucket_sigma == 1.0), \
        f"experience.bucket_mean and bucket_sigma apply to bucket_scheme normal only (scheme is {e.bucket_scheme!r})"
    yield 0 <= e.lbound < rbound <= K - 1, \
        (f"experience.lbound ({e.lbound}) < experience.rbound ({rbound}) <= num_generations-1 ({K - 1}) must hold, "
         "with lbound >= 0")
    yield _optional_at_least("experience.max_trajectories_per_question", e.max_trajectories_per_question, 1)
    yield _optional_at_least("experience.max_questions", e.max_questions, 1)
    yield _at_least("experience.selection_batch_size", e.selection_batch_size, 1)
    yield _at_least("experience.retest_every", e.retest_every, 0)
    yield e.policy == "prioritized" or e.retest_every == 10, \
        "experience.retest_every applies to experience.policy prioritized only"
    yield e.policy == "exgrpo" or e.ratio > 0, \
        (f"experience.policy {e.policy} does nothing with experience.ratio 0 (plain GRPO): the mixed "
         "phase, where replay policies act, needs experience.ratio > 0")


def _guidance_rules(cfg: ExGRPOConfig):
    """guidance.*"""
    g, K = cfg.guidance, cfg.rollout.num_generations
    yield g.field is None or bool(g.field.strip()), "guidance.field must be null or a column name"
    yield 1 <= g.members <= K - 1, \
        f"guidance.members must be in [1, num_generations - 1 = {K - 1}] (got {g.members})"
    yield _positive("guidance.gamma", g.gamma)
    yield g.field is not None or (g.members == 1 and g.mode == "always" and g.gamma == 0.1), \
        "guidance.members, mode and gamma apply only with guidance.field set"


def _train_eval_and_logging_rules(cfg: ExGRPOConfig):
    """train.*, eval.*, logging.*"""
    m, d, t, ev, lg = cfg.model, cfg.data, cfg.train, cfg.eval, cfg.logging
    B = cfg.train.prompts_per_step
    yield _at_least("train.steps", t.steps, 1)
    yield _at_least("train.prompts_per_step", B, 1)
    yield _at_least("train.mini_batches", t.mini_batches, 1)
    yield B % t.mini_batches == 0, \
        (f"train.prompts_per_step ({B}) must be divisible by train.mini_batches ({t.mini_batches}): each "
         "mini-batch holds whole groups")
    yield _at_least("train.micro_batch_size", t.micro_batch_size, 1)
    yield _optional_at_least("train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch, 1)
    yield _optional_at_least("train.logprob_chunk_tokens", t.logprob_chunk_tokens, 1)
    yield t.dtype == "fp32" or m.dtype == "float32", \
        f"train.dtype bf16 keeps fp32 master weights: it needs model.dtype float32 (got {m.dtype!r})"
    yield _optional_at_least("data.max_prompt_length", d.max_prompt_length, 1)
    yield 0 < t.learning_rate <= 1, f"train.learning_rate must be in (0, 1] for AdamW (got {t.learning_rate})"
    yield _at_least("train.weight_decay", t.weight_decay, 0)
    yield 0 <= t.adam_beta1 < 1, f"train.adam_beta1 must be in [0, 1) (got {t.adam_beta1})"
    yield 0 <= t.adam_beta2 < 1, f"train.adam_beta2 must be in [0, 1) (got {t.adam_beta2})"
    yield 0 <= t.warmup_steps <= t.steps * t.mini_batches, \
        (f"train.warmup_steps must be in [0, train.steps x train.mini_batches = {t.steps * t.mini_batches}] "
         f"optimizer steps (got {t.warmup_steps})")
    yield _positive("train.max_grad_norm", t.max_grad_norm)
    yield _positive("train.skip_grad_norm", t.skip_grad_norm)
    yield _at_least("train.max_skipped_updates", t.max_skipped_updates, 0)
    yield _at_least("train.seed", t.seed, 0)
    yield _at_least("train.save_every", t.save_every, 0)
    yield _at_least("train.save_total_limit", t.save_total_limit, 1)
    yield _at_least("train.threads", t.threads, 0)
    yield _at_least("eval.every", ev.every, 0)
    yield _at_least("eval.samples", ev.samples, 1)
    yield _positive("eval.temperature", ev.temperature)
    yield _optional_at_least("eval.max_questions", ev.max_questions, 1)
    yield _text("logging.output_dir", lg.output_dir)
    yield _at_least("logging.sample_every", lg.sample_every, 0)


def engine_correction_cap(cfg: ExGRPOConfig) -> float | None:
    """objective.tis_cap when truncated IS corrects the engine (tis, or auto with the vllm engine in another
    precision than the trainer's); None otherwise."""
    mode = cfg.objective.engine_correction
    mismatch = cfg.rollout.engine == "vllm" and engine_precision(cfg) != compute_precision(cfg)
    return cfg.objective.tis_cap if mode == "tis" or (mode == "auto" and mismatch) else None


def compute_precision(cfg: ExGRPOConfig) -> str:
    """The dtype the trainer's forward passes run in."""
    return "bfloat16" if cfg.train.dtype == "bf16" else cfg.model.dtype


def engine_precision(cfg: ExGRPOConfig) -> str:
    """The dtype rollouts are sampled in (the hf engine samples with the trainer's own forward)."""
    r = cfg.rollout
    return r.engine_dtype if r.engine == "vllm" and r.engine_dtype != "auto" else compute_precision(cfg)


# Changing these on resume leaves the algorithm as it was: length, bookkeeping, memory, speed and sharding.
RESUMABLE_CHANGES = ("train.steps", "train.save_every", "train.save_total_limit", "train.threads",
                     "train.check_replicas", "train.max_skipped_updates", "train.micro_batch_size",
                     "train.max_tokens_per_micro_batch", "train.logprob_chunk_tokens", "train.activation_checkpointing",
                     "train.sharding",
                     "rollout.generation_batch_size", "rollout.gpu_memory_utilization", "rollout.kv_cache_gb",
                     "rollout.sync_timeout", "rollout.parity_every", "rollout.parity_threshold",
                     "experience.selection_batch_size", "reward.workers",
                     "reward.timeout", "eval.", "logging.")


def config_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """The fields where two resolved configs (`to_dict()`) differ, as "field: old -> new", split into (changes
    that alter the algorithm, harmless ones listed in RESUMABLE_CHANGES)."""
    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict) and not (prefix + key == "model.lora"):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    a, b = flat(old), flat(new)
    algorithmic, harmless = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
            is_harmless = any(key == h or (h.endswith(".") and key.startswith(h)) for h in RESUMABLE_CHANGES)
            (harmless if is_harmless else algorithmic).append(line)
    return algorithmic, harmless


# ---------------------------------------------------------------- building from dicts, YAML, overrides
def _resolve(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) of a field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), len(args) < len(typing.get_args(tp))
    return tp, False


def _coerce(value: Any, tp: Any, where: str) -> Any:
    inner, optional = _resolve(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed (expected {_describe(inner)})")
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {sorted(f.name for f in dataclasses.fields(inner))}")
        return _build(inner, value, where)
    if typing.get_origin(inner) is Literal:
        allowed = typing.get_args(inner)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not allowed; expected one of {list(allowed)}")
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if inner is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if inner is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if inner is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return f"one of {list(typing.get_args(tp))}"
    return getattr(tp, "__name__", str(tp))


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        of = f" of {prefix}" if prefix else ""
        raise ConfigError(f"unknown config field '{where}'; allowed fields{of}: {sorted(names)}")
    kwargs = {name: _coerce(v, hints[name], f"{prefix}.{name}" if prefix else name) for name, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - all fields have defaults
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{key}' is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Accept `key.sub=value`, `--key.sub=value` and `--key.sub value`; values are parsed as YAML scalars."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        key = arg[2:] if arg.startswith("--") else arg
        if "=" in key:
            key, raw = key.split("=", 1)
        elif arg.startswith("--") and i + 1 < len(args):
            i += 1
            raw = args[i]
        else:
            raise ConfigError(f"override {arg!r} must look like section.field=value or --section.field value")
        pairs.append((key, yaml.safe_load(raw) if raw != "" else ""))
        i += 1
    return pairs


def read_yaml(path: Path, what: str):
    """The parsed YAML of `path`; a missing file or invalid YAML is a ConfigError naming it."""
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> ExGRPOConfig:
    """Defaults, then `base` (e.g. a checkpoint's resolved config) or the YAML file, then dotted overrides."""
    tree: dict = dict(base or {})
    if path is not None:
        path = Path(path)
        loaded = read_yaml(path, "config file")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        tree = loaded or {}
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    try:
        return _build(ExGRPOConfig, tree)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def config_from_dict(values: dict) -> ExGRPOConfig:
    return _build(ExGRPOConfig, values)
