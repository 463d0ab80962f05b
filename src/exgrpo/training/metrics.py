"""Every logged metric, defined once: the registry behind docs/metrics.md (`python -m exgrpo.training.metrics`) and the
function that computes a step's metrics. Names follow TRL where they overlap."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from exgrpo.experience import ExperienceBuffer
from exgrpo.tensors import PackedBatch
from exgrpo.learner.learner import UpdateResult
from exgrpo.runtime.tracking import RENAMED_METRICS
from exgrpo.records import Group, GroupRewards
from exgrpo.training.generation import GenerationStats


@dataclass(frozen=True)
class Metric:
    name: str  # a `{placeholder}` stands for a family, e.g. experience/bucket_{k}
    meaning: str
    section: str

    def matches(self, key: str) -> bool:
        pattern = re.sub(r"\\\{[a-z_]+\\\}", r"[^/]+", re.escape(self.name))
        return re.fullmatch(pattern, key) is not None


def _section(title: str, *entries: tuple[str, str]) -> list[Metric]:
    return [Metric(name, meaning, title) for name, meaning in entries]


METRICS: tuple[Metric, ...] = tuple(
    _section(
        "Every line",
        ("step", "The training step the line belongs to (1 after the first step)."),
        ("time", "Unix time when the line was written."),
    ) + _section(
        "Rollouts and rewards",
        ("phase", "`warmup` (plain GRPO, PPO clipping) or `mixed` (experience replay): the phase the step ran in."),
        ("phase_mixed", "1 when the step ran in the mixed phase, else 0 (`phase` as a number, for plots)."),
        ("reward", "Mean total reward (weighted sum of the reward functions) over all B×K group members of the "
                   "step, replayed members included."),
        ("reward_std", "Mean over groups of the standard deviation (ddof 0) of the K rewards within a group."),
        ("frac_reward_zero_std", "Fraction of groups whose K rewards are all equal: their advantages are 0, so "
                                 "they contribute no policy gradient (only the entropy bonus)."),
        ("batch/pass_at_1", "Fraction of the step's group members counted correct (reward ≥ "
                         "`reward.success_threshold`): the batch Pass@1 that the delayed start compares with "
                         "`experience.start_threshold`."),
        ("completions/mean_length", "Mean completion length in tokens over all group members (EOS included)."),
        ("rewards/{name}/mean", "Mean of reward function `name` over the completions it gave a reward for "
                                "(before weighting; NaN when it returned None for all)."),
        ("grading/timeouts", "Completions whose grading ran past `reward.timeout` this step (scored 0)."),
        ("grading/crashes", "Completions whose grading worker died this step (scored 0)."),
        ("grading/errors", "Completions whose grader or reward function raised this step (scored 0)."),
        ("completions/clipped_ratio", "Fraction of the step's fresh rollouts stopped by "
                                      "`rollout.max_completion_length` before an EOS."),
        ("tokens_per_second", "Completion tokens of the step (replays included) divided by `time/step`."),
    ) + _section(
        "Update (over all mini- and micro-batches of the step; means weighted by tokens)",
        ("loss", "The optimised loss, summed over micro-batches and mini-batches (and ranks)."),
        ("grad_norm", "Mean over the step's optimizer steps of the global gradient norm before clipping."),
        ("learning_rate", "The scheduler's learning rate after the step."),
        ("skipped_optimizer_steps", "Optimizer steps skipped so far because the gradient norm was non-finite or above "
                            "`train.skip_grad_norm` (cumulative)."),
        ("skipped_zero_advantage_steps", "Optimizer steps skipped so far because every advantage of their "
                                         "mini-batch was 0 (`train.zero_advantage_steps` skip; cumulative)."),
        ("zero_advantage_steps", "Optimizer steps of this step whose mini-batch had every advantage 0: applied on "
                                 "the entropy bonus alone (`train.zero_advantage_steps` apply) or skipped (skip)."),
        ("entropy", "Mean per-token entropy (nats, temperature `rollout.temperature`) of the current policy over "
                    "all completion tokens, from the training forward passes."),
        ("entropy/replayed", "Token-mean entropy under the current policy (training forward) of the step's replayed "
                             "trajectories; only in steps that replay."),
        ("entropy/fresh_correct", "The same over the step's correct fresh rollouts: compare with "
                                  "`entropy/replayed` (the replayed one is the lowest-entropy stored trajectory)."),
        ("ratio/mean", "Mean of r = π_θ / π_old over fresh tokens (π_old: the pre-update policy of this step); "
                       "1 in the first mini-batch."),
        ("ratio/min", "Minimum of r over fresh tokens."),
        ("ratio/max", "Maximum of r over fresh tokens."),
        ("clip_ratio/low_mean", "Fraction of fresh tokens with r < 1 − ε_low and A < 0 (PPO-clipped from below); 0 "
                                "when fresh tokens are not clipped (mixed phase, unless `clip_after_switch`)."),
        ("clip_ratio/high_mean", "Fraction of fresh tokens with r > 1 + ε_high and A > 0 (PPO-clipped from above)."),
        ("clip_ratio/region_mean", "`clip_ratio/low_mean` + `clip_ratio/high_mean`."),
        ("tis/weight_mean", "Mean truncated-IS weight min(pi_old / pi_engine, objective.tis_cap) of fresh tokens (only "
                            "with the engine correction on)."),
        ("tis/weight_min", "Smallest truncated-IS weight of the step's fresh tokens."),
        ("tis/ess", "Normalised effective sample size (Σw)² / (n Σw²) of the fresh tokens' truncated-IS weights, in "
                    "(0, 1] (1: all equal); per micro-batch, token-weighted over the step."),
        ("tis/truncated_fraction", "Share of the fresh tokens whose weight pi_old / pi_engine reached "
                                   "`objective.tis_cap` (and was cut to it)."),
        ("replay/ratio_mean", "Mean of w = π_θ / π_recorded over replayed tokens (π_recorded: the behaviour "
                              "log-probs stored with the trajectory). Only in steps that replay."),
        ("replay/ratio_min", "Minimum of w over replayed tokens."),
        ("replay/ratio_max", "Maximum of w over replayed tokens."),
        ("replay/shaped_weight_mean", "Mean of the policy-shaped weight f(w) = w / (w + β) over replayed tokens (w "
                                      "itself with `objective.policy_shaping: false`)."),
        ("replay/age_mean", "Mean age in steps of the step's replayed trajectories (this step minus the step that "
                            "collected them; 1 is the youngest possible). Only in steps that replay."),
        ("replay/age_max", "The oldest replayed trajectory's age in steps."),
        ("replay/version_lag_mean", "Mean of (the learner's weights version before this step's update) − (the "
                                    "version of the replayed trajectory's recorded log-probs): the optimizer steps "
                                    "w = π_θ / π_recorded spans."),
        ("replay/uses_mean", "Mean number of earlier steps that trained on the replayed trajectories (0: first "
                             "replay)."),
    ) + _section(
        "Generation rounds (`rollout.zero_variance`)",
        ("generation/rounds", "Rounds of generation in the step (1 with `keep`)."),
        ("generation/rollouts", "Fresh rollouts sampled in the step over all rounds, dropped groups included."),
        ("generation/zero_variance_fraction", "Zero-variance groups / all groups rolled out in the step (before "
                                              "dropping)."),
        ("generation/informative_groups", "Groups of the step with unequal rewards (the ones trained on, unless "
                                          "`keep`)."),
        ("generation/rollouts_per_informative_group", "`generation/rollouts` / `generation/informative_groups`: "
                                                      "the rollout cost of one group with a gradient."),
    ) + _section(
        "External guidance (with `guidance.field`)",
        ("guidance/demonstrations", "Reference solutions from the data among the step's group members."),
        ("guidance/demonstration_reward", "Their mean reward (the verifier grades them like rollouts); NaN "
                                          "without any."),
    ) + _section(
        "Asynchronous rollouts (`rollout.mode: async`, docs/async.md)",
        ("async/staleness_mean", "Token-weighted mean, over the step's fresh tokens, of the learner's weights "
                                 "version minus the version that sampled them (applied optimizer steps; "
                                 "max_staleness × mini_batches at most)."),
        ("async/staleness_max", "The largest such lag."),
        ("async/learner_idle", "Seconds of the step the learner waited for the engine (rollouts, pushes, "
                               "evaluation)."),
        ("async/engine_idle", "Seconds of the step the engine had no call to run."),
    ) + _section(
        "Rollout engine (vllm)",
        ("rollout/logp_diff_mean", "Mean |log pi_engine - log pi_trainer| over the step's sampled tokens (the parity "
                                   "probe, every `rollout.parity_every` steps): about 1e-5 in fp32 when the engine "
                                   "runs the trainer's weights; above `rollout.parity_threshold` the run stops."),
        ("rollout/logp_diff_max", "The largest such difference."),
    ) + _section(
        "Experience buffer (after the step)",
        ("experience/questions", "Questions holding at least one stored trajectory: the set experiential "
                                 "questions are drawn from."),
        ("experience/trajectories", "Stored trajectories."),
        ("experience/bucket_{k}", "Questions in correctness bucket k (latest success count k of K); logged for "
                                  "non-empty buckets."),
        ("experience/retired", "Questions retired so far (a group solved K/K): never drawn again."),
        ("experience/retired_this_step", "Questions retired by this step's groups."),
        ("experience/replayed", "Experiential questions in this step, i.e. replayed trajectories (one each)."),
        ("experience/replay_fraction", "Experiential groups / all groups of the step."),
        ("fresh_questions_remaining", "Training questions not retired (the pool fresh questions come from)."),
        ("coverage/ever_correct", "Distinct training questions with at least one correct rollout of the policy's "
                                  "own so far (demonstrations and replays do not count)."),
    ) + _section(
        "Time (seconds of wall time in the step)",
        ("time/step", "The whole step."),
        ("time/buffer", "Bucket sampling and collection into the buffer."),
        ("time/selection", "Replay selection: scoring every stored candidate of the experiential questions with "
                           "the current policy."),
        ("time/rollout", "Generation of the fresh rollouts."),
        ("time/reward", "Grading (reward functions)."),
        ("time/logprob", "The no-grad pre-update log-prob pass (only with `train.mini_batches` > 1)."),
        ("time/update", "Forward, backward and optimizer steps of the update."),
        ("time/forward", "The training forward passes inside `time/update` (log-softmax and entropy included)."),
        ("time/optimizer", "Gradient clipping and the AdamW steps inside `time/update`."),
        ("time/push", "Pushing the updated weights into an engine with a copy of them (rollout.mode sync; in async "
                      "mode the push runs on the rollout worker and only its submission is timed here)."),
    ) + _section(
        "Held-out evaluation (every `eval.every` steps, and after the last step)",
        ("eval/accuracy", "avg@`eval.samples` on the held-out questions: mean correctness (reward ≥ "
                          "`reward.success_threshold`) over all samples, at temperature `eval.temperature`."),
        ("eval/stderr", "Standard error of `eval/accuracy` over questions (a question's samples are not "
                        "independent)."),
    ) + _section(
        "Data parallel (with `train.check_replicas`)",
        ("replicas/buffer_hash", "SHA-256 of the experience buffer's content; equal on every rank or the run stops."),
        ("replicas/param_hash", "SHA-256 of the trainable parameters; equal on every rank or the run stops."),
        ("replicas/count", "Number of ranks compared."),
    )
)


def definition(key: str) -> Metric | None:
    """The registry entry of a logged key (None when it has none)."""
    return next((m for m in METRICS if m.matches(key)), None)


def markdown() -> str:
    """docs/metrics.md."""
    lines = ["# Logged metrics", "",
             "Every line of `metrics.jsonl` (and every TensorBoard scalar) is one of these. Generated from "
             "`exgrpo.training.metrics.METRICS` by `python -m exgrpo.training.metrics > docs/metrics.md`.", ""]
    for section in dict.fromkeys(m.section for m in METRICS):
        lines += [f"## {section}", "", "| metric | meaning |", "|---|---|"]
        lines += [f"| `{m.name}` | {m.meaning} |" for m in METRICS if m.section == section]
        lines.append("")
    lines += ["## Renamed", "", "A `metrics.jsonl` written before a rename is read under the new names by exgrpo's "
              "reports (`exgrpo.runtime.tracking.read_metrics`); TensorBoard keeps the old tags of those steps.", "",
              "| old name | new name |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in RENAMED_METRICS.items()]
    lines.append("")
    return "\n".join(lines)


@dataclass
class StepRecord:
    """What one training step worked on and produced: the input of its metrics, kept for inspection (tests,
    notebooks) as `ExGRPOTrainer.last_step`."""

    phase: str
    groups: list[Group]
    rewards: GroupRewards  # (G, K)
    correct: np.ndarray  # (G, K) reward >= reward.success_threshold
    advantages: torch.Tensor  # (G, K)
    batch: PackedBatch  # row g*K + j is member j of group g
    update: UpdateResult
    generation: GenerationStats


def step_metrics(record: StepRecord, buffer: ExperienceBuffer, *, step: int, version: int, fresh_remaining: int,
                 learning_rate: float, skipped: dict[str, int], ever_correct: int, guidance: bool,
                 timings: dict[str, float], elapsed: float) -> dict:
    """The metrics of one step (0-based index `step`, learner weights at `version` before its update; see
    METRICS), the buffer and counters as they are after it (`skipped`: the skipped optimizer steps so far, by
    metric name); `timings` holds the `time/<stage>` seconds, `elapsed` the step's wall time."""
    groups, rewards, batch = record.groups, record.rewards, record.batch
    lengths = batch.completion_mask.sum(-1)
    truncated = [m.truncated for g in groups for m in g.members if m.sampled]
    group_std = rewards.total.std(axis=1)
    n_exp = sum(g.members[0].replay is not None for g in groups)
    metrics = {
        "phase": record.phase,
        "phase_mixed": float(record.phase == "mixed"),
        "reward": float(rewards.total.mean()),
        "reward_std": float(group_std.mean()),
        "frac_reward_zero_std": float((group_std == 0).mean()),
        "batch/pass_at_1": float(record.correct.mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": float(np.mean(truncated)) if truncated else 0.0,
        "learning_rate": learning_rate,
        **{name: float(n) for name, n in skipped.items()},
        "experience/questions": float(len(buffer)),
        "experience/trajectories": float(buffer.num_trajectories),
        "experience/retired": float(buffer.num_retired),
        "experience/retired_this_step": float(record.generation.retired),
        "experience/replayed": float(n_exp),
        "experience/replay_fraction": n_exp / max(len(groups), 1),
        "fresh_questions_remaining": float(fresh_remaining),
        "time/step": elapsed,
        "tokens_per_second": float(lengths.sum()) / max(elapsed, 1e-9),
        **{f"experience/bucket_{k}": float(v) for k, v in buffer.bucket_histogram().items()},
        **{f"rewards/{name}/mean": _nanmean(values) for name, values in rewards.per_function.items()},
        **{f"grading/{k}": float(v) for k, v in rewards.grading.items() if k != "graded"},
        **timings,
        **record.update.stats,
        **record.generation.metrics(),
        "coverage/ever_correct": float(ever_correct),
        **trajectory_entropy_metrics(groups, record.correct, batch, record.update.token_entropy),
        **replay_age_metrics(groups, step, version),
    }
    if guidance:
        metrics.update(guidance_metrics(groups, rewards.total))
    return metrics


def replay_age_metrics(groups: Sequence[Group], step: int, version: int) -> dict[str, float]:
    """replay/age_*, version_lag_mean, uses_mean of the replayed members of step `step`, the learner at weights
    `version` (no replays: no metrics)."""
    replays = [g.members[0].replay for g in groups if g.members[0].replay is not None]
    if not replays:
        return {}
    ages = [step - t.step for t in replays]
    lags = [version - t.version for t in replays if t.version >= 0]
    metrics = {"replay/age_mean": float(np.mean(ages)), "replay/age_max": float(max(ages)),
               "replay/uses_mean": float(np.mean([t.uses for t in replays]))}
    if lags:
        metrics["replay/version_lag_mean"] = float(np.mean(lags))
    return metrics


def sample_lines(groups: Sequence[Group], rewards: np.ndarray, tokenizer, limit: int = 4) -> list[dict]:
    """samples.jsonl lines: the first member of the step's first `limit` groups, decoded, with its reward and whether
    it was cut at rollout.max_completion_length."""
    out = []
    for g, r in list(zip(groups, rewards))[:limit]:
        m = g.members[0]
        out.append({"question_id": g.question.id, "answer": g.question.answer, "replayed": m.replay is not None,
                    "completion": tokenizer.decode(m.completion_ids, skip_special_tokens=True), "reward": float(r[0]),
                    "truncated": m.truncated})
    return out


def guidance_metrics(groups: Sequence[Group], total: np.ndarray) -> dict[str, float]:
    """guidance/*: how many demonstrations the step's groups held and how they were graded ((G, K) `total`)."""
    rewards = [total[gi, j] for gi, g in enumerate(groups) for j, m in enumerate(g.members) if m.demonstration]
    return {"guidance/demonstrations": float(len(rewards)),
            "guidance/demonstration_reward": float(np.mean(rewards)) if rewards else float("nan")}


def trajectory_entropy_metrics(groups: Sequence[Group], correct: np.ndarray, batch: PackedBatch,
                               token_entropy: torch.Tensor) -> dict[str, float]:
    """entropy/replayed and entropy/fresh_correct: token-mean entropy of the replayed trajectories and of the
    correct fresh rollouts. `correct` is (G, K); `token_entropy` (N, T) as the update computed it."""
    members = [m for g in groups for m in g.members]
    kinds = {"entropy/replayed": [m.replay is not None for m in members],
             "entropy/fresh_correct": [m.sampled and bool(c) for m, c in zip(members, correct.reshape(-1))]}
    out = {}
    for name, selected in kinds.items():
        rows = torch.tensor(selected, dtype=torch.bool)
        mask = batch.completion_mask[rows]
        if mask.sum() > 0:
            out[name] = float((token_entropy[rows] * mask).sum() / mask.sum())
    return out


def _nanmean(values: np.ndarray) -> float:
    present = values[~np.isnan(values)]
    return float(present.mean()) if present.size else float("nan")


if __name__ == "__main__":
    sys.stdout.write(markdown())
