"""The experience side of ExGRPO (spec §2-§4): what a step asks and what the run keeps of what it saw.

`ExperienceSide` owns the phase (warm-up, then mixed after the delayed start), the fresh question pool, the buffer of
correct trajectories, the replay policy that draws experiential questions, guidance and coverage. Each step it
plans the groups (stages 1-2 of the trainer), settles each generation round (retirement and each question's k),
refills dropped slots, collects the trained groups into the buffer and decides the switch to the mixed phase. It
never touches the learner: replay candidates are scored by the function it is given, and the weights version
comes with each call that needs it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from exgrpo.config import ConfigError, ExGRPOConfig
from exgrpo.data import Question, QuestionPool
from exgrpo.experience import (SELECTION_METRICS, SELECTION_MODES, ExperienceBuffer, num_experiential,
                               replay_policy_from_config, select_replays)
from exgrpo.records import MIXED, WARMUP, Group, PlannedStep, Trajectory, own_members
from exgrpo.runtime.timing import StageTimer
from exgrpo.tensors import TrajectoryScore
from exgrpo.training.generation import ZERO_VARIANCE_RULES
from exgrpo.training.groups import form_groups
from exgrpo.training.guidance import Guidance

ScoreCandidates = Callable[[list[tuple[Question, Trajectory]], TrajectoryScore], list[float]]


def _refuse_fewer_questions_than_a_step(questions: int, prompts_per_step: int) -> None:
    """A step of train.prompts_per_step groups needs as many distinct questions: with fewer, every step would
    silently train on fewer groups (a setting that cannot be honoured is refused, as the config's rules do)."""
    if 0 < questions < prompts_per_step:
        raise ConfigError(f"train.prompts_per_step ({prompts_per_step}) is more than the {questions} training "
                          f"questions (after the held-out split and screening): every step would train on only "
                          f"{questions} groups; set train.prompts_per_step to at most {questions}, or train on more "
                          "questions")


class ExperienceSide:
    """Args:
        config: the run configuration.
        questions: the training questions (screened).
        prompt_ids: a question's prompt token ids.
        tokenizer: tokenizes demonstrations (guidance).
        score: selection scores of (question, stored trajectory) pairs under the current policy, by the metric given.
    """

    def __init__(self, config: ExGRPOConfig, questions: Sequence[Question], prompt_ids: Callable[[Question], list],
                 tokenizer, score: ScoreCandidates):
        c, e = config, config.experience
        _refuse_fewer_questions_than_a_step(len(questions), c.train.prompts_per_step)
        self.prompt_ids, self.score, self.K = prompt_ids, score, c.rollout.num_generations
        self.seed, self.batch_size, self.start_threshold = c.train.seed, c.train.prompts_per_step, e.start_threshold
        self.replays = e.ratio > 0  # experience.ratio 0 is plain GRPO: never the mixed phase
        self.experiential_per_step = num_experiential(self.batch_size, self.batch_size, e.ratio)
        self.buffer = ExperienceBuffer.from_config(e, self.K)
        self.question_pool = QuestionPool(questions, c.train.seed, retirement=self.buffer,
                                          at_epoch_boundary=e.retirement == "released",
                                          batch_size=c.train.prompts_per_step)
        self.guidance = Guidance.from_config(c.guidance, questions, tokenizer, c.rollout.max_completion_length)
        self.replay_policy = replay_policy_from_config(e, self.buffer, self.K)
        self.selection_metric, self.choose = SELECTION_METRICS[e.selection_metric], SELECTION_MODES[e.selection_mode]
        self.refills_from_buffer = ZERO_VARIANCE_RULES[c.rollout.zero_variance].from_buffer
        self.retires = e.retirement != "none"
        self.ever_correct: set[str] = set()  # questions with a correct rollout of the policy's own (coverage, guidance)
        self.phase = WARMUP

    def plan(self, step: int, version: int, in_flight: frozenset[str] = frozenset(),
             timer: StageTimer | None = None) -> PlannedStep:
        """Stages 1-2 for step `step`: its experiential and fresh questions (none of those `in_flight`) and their
        groups, replays and demonstrations included, from the buffer and phase as they are now."""
        timer = timer or StageTimer()
        rng = np.random.default_rng([self.seed, step])
        with timer("buffer"):
            experiential = self.sample_experiential(rng, step, exclude=in_flight) if self.phase == MIXED else []
        fresh = self.question_pool.draw(self.batch_size - len(experiential), exclude=in_flight)
        groups = self.build_groups(experiential, fresh, self.phase, rng, timer, step)
        return PlannedStep(step, self.phase, groups, version, rng)

    def sample_experiential(self, rng: np.random.Generator, step: int, n: int | None = None,
                            exclude: frozenset[str] = frozenset()) -> list[Question]:
        """Up to n (default floor(B * ratio)) questions to re-ask in step `step`, drawn by the replay policy
        (ExGRPO: from the correctness buckets), none of them in `exclude`."""
        n = self.experiential_per_step if n is None else n
        return [self.question_pool.questions[qid] for qid in self.replay_policy.experiential(n, rng, step, exclude)]

    def build_groups(self, experiential: list[Question], fresh: list[Question], phase: str,
                     rng: np.random.Generator, timer: StageTimer, step: int) -> list[Group]:
        """The step's groups, those whose question replays a stored trajectory first (member 0: the replay)."""
        policy = self.replay_policy
        replayed, plain = experiential, fresh
        if not policy.replays_trajectories:
            replayed, plain = [], experiential + fresh
        elif policy.replays_into_fresh and phase == MIXED:
            replayed = experiential + [q for q in fresh if q.id in self.buffer]
            plain = [q for q in fresh if q.id not in self.buffer]
        with timer("selection"):
            replays = self.select_replays(replayed, rng)
        groups = form_groups(list(zip(replayed, replays)), plain, self.prompt_ids)
        self.guidance.add(groups, step, self.ever_correct)
        return groups

    def select_replays(self, questions: Sequence[Question], rng: np.random.Generator) -> list[Trajectory]:
        """For each question, the stored trajectory the selection rule picks under the current policy."""
        candidates = [(q, self.buffer.trajectories(q.id)) for q in questions]
        return select_replays(candidates, self.selection_metric, self.choose, rng, score=self.score)

    def settle(self, groups: list[Group], correct: np.ndarray, step: int) -> int:
        """A generation round's outcome, dropped groups included: questions whose own members are all correct are
        retired (spec §2; returns how many now) unless experience.retirement is none; each question's k goes to the
        replay policy; questions with a correct rollout of the policy's own are marked ever correct (coverage; guidance
        fallback)."""
        retired = 0
        for g, ok, own in zip(groups, correct, own_members(groups)):
            k = int(ok[own].sum())
            if k == own.sum() and self.retires and not self.buffer.is_retired(g.question.id):
                self.buffer.retire(g.question.id)
                retired += 1
            self.replay_policy.observe(g.question.id, k, step)
            if k:
                self.ever_correct.add(g.question.id)
        return retired

    def refill(self, n: int, planned: PlannedStep, asked: frozenset[str], timer: StageTimer) -> list[Group]:
        """n groups for the planned step's dropped slots: with replace_from_buffer in the mixed phase, experiential
        questions not asked yet this step (with their replays), then fresh questions."""
        experiential = []
        if self.refills_from_buffer and planned.phase == MIXED:
            experiential = self.sample_experiential(planned.rng, planned.step, n, asked)
        fresh = self.question_pool.draw(n - len(experiential))
        return self.build_groups(experiential, fresh, planned.phase, planned.rng, timer, planned.step)

    def collect_step(self, planned: PlannedStep, groups: list[Group], correct: np.ndarray,
                     completion_mask: torch.Tensor, old_logp: torch.Tensor, version: int) -> None:
        """Stage 11: the trained groups into the buffer (`collect`) in the mixed phase; nothing in the warm-up.
        `completion_mask`: (G*K, T) of the packed batch."""
        if planned.phase == MIXED:
            self.collect(groups, correct, completion_mask.sum(-1).to(torch.long).tolist(), old_logp,
                         planned.step, version)

    def collect(self, groups: list[Group], correct: np.ndarray, lengths: list[int], old_logp: torch.Tensor,
                step: int, version: int) -> None:
        """Move each group's question to its bucket and store its new correct trajectories with behaviour
        log-probs, the pre-update policy's at weights `version` (`old_logp`: (G*K, T), rows in group order, the
        first `lengths[row]` of each valid); count a use of each replayed trajectory. Demonstrations are
        neither counted in k nor stored: the buffer holds the policy's own trajectories."""
        row = 0
        for g, ok, own in zip(groups, correct, own_members(groups)):
            ids, lps = [], []
            for m in g.members:
                ids.append(np.asarray(m.completion_ids, dtype=np.int32))
                lps.append(old_logp[row, :lengths[row]].numpy())
                row += 1
            if g.members[0].replay is not None and g.question.id in self.buffer:
                self.buffer.record_replay(g.question.id, ids[0])
            self.buffer.update_group(g.question.id, [bool(x) for x in ok & own], ids, lps, step=step,
                                     version=version)  # ignores retired

    def switch_phase(self, pass_at_1: float) -> None:
        """The delayed start: switch for good to the mixed phase once batch Pass@1 > start_threshold (strict)."""
        if self.phase == WARMUP and self.replays and pass_at_1 > self.start_threshold:
            self.phase = MIXED

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """{"trainer": the JSON-able part, "buffer": the buffer's state}."""
        return {"trainer": {"phase": self.phase, "pool": self.question_pool.state_dict(),
                            "replay_policy": self.replay_policy.state_dict(),
                            "ever_correct": sorted(self.ever_correct)},
                "buffer": self.buffer.state_dict()}

    def load_state_dict(self, trainer: dict, buffer: dict) -> None:
        self.buffer.load_state_dict(buffer)
        self.phase = trainer["phase"]
        self.question_pool.load_state_dict(trainer["pool"])
        self.replay_policy.load_state_dict(trainer.get("replay_policy", {}))
        self.ever_correct = set(trainer.get("ever_correct", []))
