"""The typed configuration of a run: one dataclass per section, each field documented where it is declared.

Names follow TRL where they overlap (num_generations, max_completion_length, temperature, epsilon, beta,
learning_rate, scale_rewards); defaults follow the released ExGRPO run script (spec §7) unless a comment says why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from exgrpo.config.rules import validate

# The string-chosen variants. The code that implements one keeps a registry keyed by exactly these values
# (tests/config/test_variants.py checks it): adding a variant is one value here and one entry there.
ZeroVariance = Literal["keep", "backfill", "replace_from_buffer"]
ScaleRewards = Literal["none", "group"]
Aggregation = Literal["sum_constant", "token_mean", "seq_mean_token_mean"]
BucketScheme = Literal["normal", "linear", "sqrt", "linear_clip", "uniform"]
SelectionMetric = Literal["entropy", "entropy_sum", "perplexity", "random"]
SelectionMode = Literal["argmin", "argmax"]
ReplayPolicyName = Literal["exgrpo", "rlep", "prioritized", "prompt_replay"]
EngineName = Literal["hf", "vllm", "servers"]

# What a field says of itself beyond its type, default and text (dataclass field metadata): whether a resumed run may
# change it (`exgrpo.config.changes`) and its former name (`exgrpo.config.renamed`).
RESUMABLE = {"resumable": True}  # a change on resume leaves the algorithm as it was: length, bookkeeping, speed, memory


def resumable(default, formerly: str | None = None):
    """A field a resumed run may change; `formerly`: its old name in the same section, still read as this one."""
    return field(default=default, metadata={**RESUMABLE, "formerly": formerly})


def renamed(default, formerly: str):
    """A field that was called `formerly` in the same section, still read as this one."""
    return field(default=default, metadata={"formerly": formerly})


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

    @property
    def modules(self) -> str | list[str]:
        """`target_modules` as peft takes it: "all-linear", or the list of names (peft reads a lone string as a
        regular expression over full module paths, so a name is always passed in a list)."""
        if self.target_modules == "all-linear":
            return self.target_modules
        return [name.strip() for name in self.target_modules.split(",")]


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """HF hub id, local directory, or a built-in preset: smollm2-135m-instruct, gemma3-270m, tiny, tiny:<seed>."""
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
    engine: EngineName = "hf"
    """Rollout engine: hf (transformers generate on the training model), vllm (a vLLM engine of this run with its
    own copy of the weights, synced after every optimizer step; needs the vllm extra) or servers (`vllm serve`
    servers at rollout.servers, the weights pushed to them over vLLM's weight-transfer interface; docs/scale.md)."""
    servers: str = ""
    """servers: the servers' base URLs, comma separated (http://host:port,...); start each with `exgrpo serve`."""
    weight_transfer: Literal["exgrpo_gloo"] = "exgrpo_gloo"
    """servers: the weight-transfer backend the servers run (exgrpo_gloo: ours, over gloo; CPU or GPU servers)."""
    transfer_address: str = "127.0.0.1"
    """servers: this host's address as the servers reach it (where the weight-transfer group meets)."""
    transfer_port: int = 0
    """servers: the port the weight-transfer group meets on at transfer_address; 0: a free one."""
    mode: Literal["sync", "async"] = "sync"
    """sync: each step samples from the current weights, then updates them; async: a worker thread samples the
    next steps while the learner updates, step t from the weights after step t - max_staleness (docs/async.md;
    needs an engine with its own weights: vllm)."""
    max_staleness: int = 1
    """async: how many steps the sampling weights lag the learner's (0: the same run as sync mode)."""
    engine_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """vllm, servers: the engine's precision; auto is the trainer's compute precision (bfloat16 under train.dtype
    bf16)."""
    max_model_len: int | None = None
    """vllm, servers (`exgrpo serve`): prompt + completion tokens per sequence; null: data.max_prompt_length (else
    the longest prompt in the data) + max_completion_length."""
    gpu_memory_utilization: float = resumable(0.5)
    """vllm on CUDA: the share of GPU memory the colocated engine may take (weights and KV cache)."""
    kv_cache_gb: float | None = resumable(None)
    """vllm on CPU: KV-cache memory in GiB; null: room for generation_batch_size full-length sequences."""
    push_timeout: float = resumable(120.0, formerly="sync_timeout")
    """vllm, servers: seconds one weight push into the engine (each of its requests to a server) may take before the
    run stops with an error. Formerly rollout.sync_timeout, still read as this."""
    generation_timeout: float = resumable(3600.0)
    """async: seconds the learner waits for any one result of the rollout worker (a step's rollouts, a whole
    held-out evaluation, or a push queued behind them) before the run stops with an error: set it above the
    longest of them."""
    parity_every: int = resumable(1)
    """vllm: every N steps compare the engine's sampling log-probs with the trainer's on the same tokens (logged
    as rollout/logp_diff_*); 0 never."""
    parity_threshold: float | None = resumable(None)
    """vllm: stop when the mean absolute log-prob difference exceeds this (a gross mismatch between engine and
    trainer); null: the measured default of the precision pair (0.01 nats fp32/fp32, 0.25 with bf16; see
    exgrpo.rollout.parity)."""
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
    generation_batch_size: int = resumable(256)
    """Sequences per generate call (memory bound); servers: requests in flight per server."""
    zero_variance: ZeroVariance = "keep"
    """Groups whose K rewards are all equal (no gradient): keep them with A = 0 (released); backfill: drop them and
    roll out further fresh questions until B informative groups or max_generation_rounds (DAPO's dynamic
    sampling); replace_from_buffer: in the mixed phase refill their slots with experiential questions (fresh
    ones once the buffer has no unused question; in the warm-up it backfills)."""
    max_generation_rounds: int = 3
    """backfill, replace_from_buffer: rounds of generation per step at most (the first included)."""

    @property
    def server_urls(self) -> list[str]:
        """`servers` as a list (empty when unset)."""
        return [url.strip() for url in self.servers.split(",") if url.strip()]


@dataclass
class RewardConfig:
    grader: Literal["math", "choice", "reasoning_gym"] = "math"
    """Built-in reward: math (math-verify against the answer), choice (option letter), reasoning_gym (the task's
    own scorer)."""
    function: str | None = None
    """A reward function 'module:name' (TRL's signature) used instead of the grader."""
    think_gate: bool = False
    """Answer = text after the first </think>; missing </think> scores 0 (released training reward: true)."""
    workers: int = resumable(2)
    """Grading processes; 0 grades in the training process."""
    timeout: float = resumable(5.0)
    """Seconds a grading worker may spend on one completion before it scores 0 (and the worker is replaced)."""
    success_threshold: float = 1.0
    """A rollout counts as correct (for k, buckets, retirement, Pass@1) when its reward >= this."""
    min_value: float = 0.0
    """The range every reward function's values are expected in (the built-in graders: [0, 1]); values outside it
    are warned about, naming the function."""
    max_value: float = 1.0
    """Upper end of that range; success_threshold must lie in (min_value, max_value]."""
    truncated: Literal["grade", "fail"] = "grade"
    """A completion cut at rollout.max_completion_length (no EOS), in training and in the held-out evaluation:
    grade = graded like any other (released); fail = scores min_value whatever it says, since its last number may
    belong to an unfinished line ("2 + 0 =" read as 2)."""


@dataclass
class ObjectiveConfig:
    scale_rewards: ScaleRewards = "none"
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
    aggregation: Aggregation = "sum_constant"
    """Token losses to a scalar: sum / normalizer (released), mean over the mini-batch's tokens, or mean over
    sequences of per-sequence token means."""
    normalizer: float | None = None
    """Constant of sum_constant aggregation; null means max_completion_length (released)."""
    entropy_coef: float = 0.001
    """Weight of the entropy bonus: minus this times the token-mean entropy of each mini-batch."""
    engine_correction: Literal["auto", "none", "tis"] = "auto"
    """Correct for an engine that samples from a slightly different distribution than the trainer computes
    (another precision or kernels): tis weights each fresh token's loss by min(pi_trainer_old / pi_engine, tis_cap)
    (truncated importance sampling); auto is tis whenever rollouts come from an engine other than the trainer's own
    forward (rollout.engine vllm, at any precision); none turns it off (refused across precisions)."""
    tis_cap: float = 2.0
    """The truncation C of the tis weight."""
    loss_scale: Literal["global", "per_rank"] = "global"
    """global: the update equals one process's over the whole mini-batch, whatever the number of ranks.
    per_rank: the released code's scale (spec §4.3), with aggregation sum_constant only: each rank's token sum over
    its own share / normalizer, gradients averaged over ranks (so the normalizer is effectively times the ranks),
    the entropy bonus over each micro-batch and summed."""


@dataclass
class ExperienceConfig:
    ratio: float = 0.5
    """Fraction of each batch's questions drawn from the buffer; 0 gives plain GRPO."""
    replay_policy: ReplayPolicyName = renamed("exgrpo", formerly="policy")
    """The replay policy (docs/replay.md): exgrpo (buckets + one replayed trajectory per experiential group), rlep
    (every fresh question with stored successes replays one; no experiential questions), prioritized (re-ask
    questions with priority p(1-p), all members fresh), prompt_replay (re-ask bucket-sampled questions, all
    members fresh)."""
    retest_every: int = 10
    """prioritized: every N-th step re-asks questions whose success rate is 0 or 1 (priority 0) instead."""
    start_threshold: float = 0.35
    """Switch to the mixed phase once batch Pass@1 > this (strict)."""
    retirement: Literal["released", "immediate", "none"] = "released"
    """What a question whose own members are all correct (K/K) leaves. released (spec §2, §9.9): experience sampling
    and the buffer at once, the fresh-question pool at the next epoch boundary and only while the pool then holds
    more than train.prompts_per_step + 20 questions; immediate: both at once (exgrpo before 2026-12-03); none:
    nothing (the paper's on-policy baseline retires nothing)."""
    bucket_scheme: BucketScheme = "normal"
    """Per-bucket weights over success counts k: normal (a Gaussian), linear k/K, sqrt, linear_clip, or uniform
    over questions (no buckets)."""
    bucket_sigma: float = 1.0
    """Standard deviation of the normal scheme, in success counts (released: 1)."""
    bucket_mean: float | None = None
    """Centre of the normal scheme in success counts; null means K/2."""
    selection_metric: SelectionMetric = "entropy"
    """What ranks a question's stored trajectories: mean token entropy under the current policy, its sum (the
    released ranking, spec §9.1), perplexity, or a uniform draw."""
    selection_mode: SelectionMode = "argmin"
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
    selection_batch_size: int = resumable(32)
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
    while the policy has no correct rollout of its own for the question yet in this run."""
    gamma: float = 0.1
    """Shaping of demonstration tokens: the loss weighs them by f(pi) = pi / (pi + gamma), pi the current policy's
    probability of the token (their behaviour probability is unknown)."""


@dataclass
class TrainConfig:
    steps: int = resumable(700)
    """Training steps (each: one batch of prompts_per_step questions, mini_batches optimizer steps)."""
    prompts_per_step: int = 128
    """B: questions per step (experiential + fresh)."""
    mini_batches: int = 2
    """Optimizer steps per training step (released: 2 mini-batches of 64 questions)."""
    micro_batch_size: int = resumable(64)
    """Sequences per forward/backward (at most); gradients accumulate over a mini-batch."""
    max_tokens_per_micro_batch: int | None = resumable(None)
    """Also cap each micro-batch at this many padded tokens (rows x (prompt + completion) width), packing rows by
    length (like verl's dynamic batch size: 32768 per GPU in the released run); null caps rows only."""
    logprob_chunk_tokens: int | None = resumable(None)
    """Compute the output head, log-softmax and entropy this many completion tokens at a time (recomputed in
    backward), so (tokens x vocabulary) logits never exist at once; null computes them in one go."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute precision: bf16 runs forward and backward in bfloat16 over fp32 master weights and optimizer
    state (log-probs, ratios and the loss stay fp32); needs model.dtype float32. Faster on GPUs and on CPUs with
    AMX; slower on CPUs without it (a warning says so)."""
    activation_checkpointing: bool = resumable(False)
    """Recompute each decoder layer's activations in backward (transformers' gradient checkpointing) instead of
    storing them."""
    compile: bool = resumable(False)
    """Compile every decoder layer with torch.compile (inductor, dynamic shapes) for the update's and scoring's
    forward and backward: on 2 CPU cores 13-18% off the update after about 45 s of compiling (docs/benchmarks.md).
    With rollout.engine vllm or servers only (generating through compiled layers recompiles them layer by layer)."""
    sharding: Literal["ddp", "fsdp"] = resumable("ddp")
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
    max_skipped_optimizer_steps: int = resumable(5, formerly="max_skipped_updates")
    """Stop with an error once more optimizer steps than this have been skipped in the run."""
    zero_advantage_steps: Literal["apply", "skip"] = "apply"
    """A mini-batch whose advantages are all 0 (every group's K rewards equal) has no policy-gradient signal: its
    gradient is the entropy bonus alone, which AdamW makes a full-size step while its moments have seen little else
    (a run with no success from its start drifts towards uniform noise). apply: step on it (released); skip:
    leave the weights and AdamW's moments as they are (the schedule still advances)."""
    seed: int = 47
    """Seeds the data order, batch composition, rollouts and held-out sampling."""
    save_every: int = resumable(50)
    """Checkpoint every N steps (and at the end, and on SIGINT/SIGTERM); 0 checkpoints only at the end."""
    save_total_limit: int = resumable(2)
    """Keep the newest N checkpoints."""
    threads: int = resumable(0)
    """torch CPU threads; 0 leaves torch's default."""
    check_replicas: bool = resumable(False)
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
    """The run directory: config.json, provenance.json, metrics.jsonl, samples.jsonl, eval_samples.jsonl,
    tensorboard/ and checkpoints/."""
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
    """Show a progress bar on stderr (false: none, nor transformers' bars for loading and saving weights)."""


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
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=RESUMABLE)
    """Periodic held-out evaluation."""
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata=RESUMABLE)
    """The run directory and where metrics go."""

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
