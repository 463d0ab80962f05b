"""Multi-seed studies: several arms (config overrides on one base config) trained from the same start with the same
seeds and budget, resumable run by run, and their results read back for the report (exgrpo.studies.report).

A study file (YAML; paths relative to it)::

    base: demo                          # the config every run starts from: a preset's name or a file
    output_dir: ../runs/study           # runs go to <output_dir>/<arm>/seed-<seed>
    seeds: [1, 2, 3]                    # default seeds of every arm
    overrides: [train.save_every=5]     # applied to every arm
    baseline: grpo                      # the arm differences are reported against
    arms:
      grpo: {label: "GRPO", overrides: [experience.ratio=0]}
      exgrpo: {label: "ExGRPO"}
      select_random: {label: "random selection", overrides: [experience.selection_metric=random], seeds: [1, 2]}
    registered:                         # the verdict rules and power statement, fixed before the runs (Registration)
      {primary: late_mean, late_evaluations: 3, verdict_rule: interval, effect: 0.035, equivalence: 0.02,
       power_sd: 0.027, power_effects: [0.02, 0.035]}

A pilot registers its criteria instead (`exgrpo.studies.criteria`)::

    registered:
      criteria: {"entropy at step 30": {measure: entropy, step: 30, at_least: 0.3}}
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from exgrpo.runtime.atomic import write_text_atomic
from exgrpo.runtime.provenance import ended_step
from exgrpo.runtime.rundir import checkpoints_gone, last_logged_step
from exgrpo.config import ConfigError, ExGRPOConfig, config_file, load_config, read_yaml
from exgrpo.studies.criteria import Criterion, criteria_from

_STUDY_KEYS = {"base", "output_dir", "seeds", "overrides", "baseline", "arms", "registered"}
_ARM_KEYS = {"label", "overrides", "seeds"}


@dataclass(frozen=True)
class Registration:
    """What a study registered before its runs (docs/results.md): the primary metric, the verdict rules and the
    power statement. Accuracies in [0, 1].

    primary: "late_mean", the mean held-out accuracy over the run's last `late_evaluations` evaluations (less
        noisy than one evaluation, and it measures what was learnt rather than a late decline), or "final", the
        last evaluation (rounds one to three).
    verdict_rule: "effect" (rounds one to five): "helps" needs a mean difference of at least `effect` and a 95%
        interval above 0 ("hurts" mirrored); "no difference" needs the whole interval inside ±`equivalence`, which
        an interval that excludes 0 can also be, so the two verdicts could contradict each other. "interval" (round
        six on): the interval decides, "helps" when it lies above 0 whatever the mean ("hurts" mirrored), so a
        "no difference" interval always includes 0; `effect` then only sizes the power statement.
    effect: the difference the study looks for ("effect": the least mean that "helps" needs).
    equivalence: "no difference" needs the whole 95% interval inside ±equivalence; it should be smaller than the
        effect of interest (rounds one to three used 0.05).
    power_sd: the paired SD of the primary difference expected from an earlier round; with it the report states
        P("helps") for each of `power_effects` and the effect detected with 80% power at the study's seeds.
    criteria: a pilot's criteria (`exgrpo.studies.criteria`), read by bench/pilot_criteria.py.
    """

    primary: str = "late_mean"
    late_evaluations: int = 3
    verdict_rule: str = "effect"
    effect: float = 0.03
    equivalence: float = 0.03
    power_sd: float | None = None
    power_effects: tuple[float, ...] = ()
    criteria: tuple[Criterion, ...] = ()

    def primary_points(self, per_evaluation: np.ndarray) -> np.ndarray:
        """The entries of (E,) `per_evaluation` (step 0 first) that the primary metric reads."""
        return per_evaluation[-1:] if self.primary == "final" else per_evaluation[1:][-self.late_evaluations:]


_REGISTRATION_KEYS = {"primary", "late_evaluations", "verdict_rule", "effect", "equivalence", "power_sd",
                      "power_effects", "criteria"}


def _registration(value, where: str) -> Registration:
    value = value or {}
    if not isinstance(value, dict) or set(value) - _REGISTRATION_KEYS:
        raise ConfigError(f"{where}: expected a mapping with keys among {sorted(_REGISTRATION_KEYS)}, got {value!r}")
    try:
        reg = Registration(**{k: tuple(v) if k == "power_effects" else v for k, v in value.items()
                              if k != "criteria"},
                           criteria=criteria_from(value["criteria"], f"{where}.criteria") if "criteria" in value else ())
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    if reg.primary not in ("late_mean", "final") or not (isinstance(reg.late_evaluations, int)
                                                         and reg.late_evaluations >= 1):
        raise ConfigError(f"{where}: primary must be late_mean or final and late_evaluations an integer >= 1")
    if reg.verdict_rule not in ("effect", "interval"):
        raise ConfigError(f"{where}: verdict_rule must be effect or interval, got {reg.verdict_rule!r}")
    return reg


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    overrides: tuple[str, ...]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Study:
    path: Path
    base: Path
    output_dir: Path
    overrides: tuple[str, ...]
    baseline: str
    arms: tuple[Arm, ...]
    registered: Registration = Registration()

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise ConfigError(f"{self.path}: no arm {name!r}; arms: {', '.join(a.name for a in self.arms)}")

    def run_dir(self, arm: Arm, seed: int) -> Path:
        return self.output_dir / arm.name / f"seed-{seed}"

    def start_over(self, arm: Arm, seed: int) -> str:
        """The command that starts one run of the study over (deleting what it holds)."""
        return f"`exgrpo experiment run {self.path} --arms {arm.name} --seeds {seed} --overwrite`"

    def config(self, arm: Arm, seed: int) -> ExGRPOConfig:
        overrides = [*self.overrides, *arm.overrides, f"train.seed={seed}",
                     f"logging.output_dir={self.run_dir(arm, seed)}"]
        try:
            return load_config(self.base, overrides)
        except ConfigError as e:
            raise ConfigError(f"{self.path}: arm {arm.name!r}: {e}") from None

    def initial_eval_path(self, config: ExGRPOConfig) -> Path:
        """Where the before-training evaluation of a run is kept. Runs whose start is the same (model, data,
        rollout, reward, eval settings and seed) share it, so each seed's starting point is evaluated once."""
        d = config.to_dict()
        d["eval"].pop("every")
        start = {k: d[k] for k in ("model", "data", "rollout", "reward", "eval")} | {"seed": config.train.seed}
        key = hashlib.sha256(json.dumps(start, sort_keys=True).encode()).hexdigest()[:16]
        return self.output_dir / "initial" / f"{key}.json"


def _seeds(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(s, int) and not isinstance(s, bool)
                                                            for s in value):
        raise ConfigError(f"{where}: expected a non-empty list of integer seeds, got {value!r}")
    repeated = sorted({s for s in value if value.count(s) > 1})
    if repeated:
        raise ConfigError(f"{where}: seed {', '.join(map(str, repeated))} appears more than once in {value}; expected "
                          "distinct seeds (each seed is one run of the arm, and the report pairs arms by seed)")
    return tuple(value)


#: fields a study sets itself for each run: an override of them is refused, with the reason
_STUDY_OWNED = {"logging.output_dir": "runs go to <output_dir>/<arm>/seed-<seed>; set the study's output_dir",
                "train.seed": "each run's seed is one of the arm's seeds; set the arm's seeds",
                "logging.overwrite": "the study resumes its runs; start runs over with `exgrpo experiment run "
                                     "STUDY --arms ARM --seeds SEED --overwrite`"}


def _overrides(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(o, str) and "=" in o for o in value):
        raise ConfigError(f"{where}: expected a list of 'section.field=value' strings, got {value!r}")
    for override in value:
        key = override.split("=", 1)[0].removeprefix("--")
        if key in _STUDY_OWNED:
            raise ConfigError(f"{where}: {override!r}: the study sets {key} itself ({_STUDY_OWNED[key]})")
    return tuple(value)


def _arm_name(name, where: str) -> str:
    """An arm's name, which is a directory of the study's output_dir: a plain name."""
    if name is None or isinstance(name, bool):  # the arms `on:` and `off:` would run in True/ and False/
        raise ConfigError(f"{where}: arm name {name} is how YAML reads an unquoted on/off, yes/no, true/false (None: "
                          "null, ~ or nothing); quote the name")
    text = str(name)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", text) or text == "initial":
        raise ConfigError(f"{where}: arm name {text!r} is not a plain name: expected letters, digits and _ . + - "
                          "(a letter or digit first, no path separators; 'initial' holds the before-training "
                          "evaluations)")
    return text


def load_study(path: str | Path) -> Study:
    path = Path(path)
    raw = read_yaml(path, "study file")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {sorted(_STUDY_KEYS)}")
    unknown = set(raw) - _STUDY_KEYS
    missing = {"base", "output_dir", "seeds", "arms"} - set(raw)
    if unknown or missing:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    if not isinstance(raw["arms"], dict) or not raw["arms"]:
        raise ConfigError(f"{path}: arms: expected a mapping of arm names to {{label, overrides, seeds}}")
    seeds = _seeds(raw["seeds"], f"{path}: seeds")
    arms = []
    for name, spec in raw["arms"].items():
        spec = spec or {}
        if not isinstance(spec, dict) or set(spec) - _ARM_KEYS:
            raise ConfigError(f"{path}: arms.{name}: expected a mapping with keys among {sorted(_ARM_KEYS)}")
        if str(name) in {a.name for a in arms}:
            raise ConfigError(f"{path}: arms: two arms are named {str(name)!r} (as text, which names their run "
                              "directories); expected distinct names")
        arms.append(Arm(_arm_name(name, f"{path}: arms"), str(spec.get("label", name)),
                        _overrides(spec.get("overrides"), f"{path}: arms.{name}.overrides"),
                        _seeds(spec["seeds"], f"{path}: arms.{name}.seeds") if "seeds" in spec else seeds))
    root = path.parent
    study = Study(path, config_file(str(raw["base"]), relative_to=root).resolve(), (root / raw["output_dir"]).resolve(),
                  _overrides(raw.get("overrides"), f"{path}: overrides"), str(raw.get("baseline", arms[0].name)),
                  tuple(arms), _registration(raw.get("registered"), f"{path}: registered"))
    study.arm(study.baseline)
    for arm in study.arms:  # every run's config must build before the first one starts
        study.config(arm, arm.seeds[0])
    return study


def run_complete(run_dir: Path, steps: int) -> bool:
    """Trained to `steps`, or stopped earlier with every training question retired (nothing left to train on): that
    step logged no fresh question remaining. How far the run got is its last checkpoint's step, or, for a run whose
    checkpoints were removed after it finished, the step its provenance records it ending at by itself."""
    from exgrpo.runtime.tracking import read_metrics

    done = finished_steps(run_dir)
    if done >= steps:
        return True
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if m["step"] == done] if done else []
    return bool(rows) and rows[-1]["fresh_questions_remaining"] == 0


def finished_steps(run_dir: Path) -> int:
    """The steps the run keeps: its last checkpoint's, or the step it ended at by itself (`ended_step`)."""
    return max(completed_steps(run_dir), ended_step(run_dir))


def completed_steps(run_dir: Path) -> int:
    from exgrpo.runtime.checkpoint import checkpoint_step, latest_checkpoint

    latest = latest_checkpoint(run_dir)
    return checkpoint_step(latest) if latest is not None else 0


def run_state(run_dir: Path, steps: int, start_over: str = "--overwrite") -> tuple[bool, int, str]:
    """Whether the run is complete (`run_complete`), its last checkpoint's step, and what is on disk in words: the
    last checkpoint and the steps logged (metrics.jsonl); `start_over` is the command that starts it over."""
    done = completed_steps(run_dir)
    if run_complete(run_dir, steps):
        kept = "" if done else "; its checkpoints removed"
        return True, done, f"complete ({finished_steps(run_dir)} steps{kept})"
    if not run_dir.exists():
        return False, done, "not started"
    logged = last_logged_step(run_dir)
    if done:
        rerun = f", logged to step {logged} (a resume runs the steps after {done} again)" if logged > done else ""
        return False, done, f"checkpointed at step {done} of {steps}{rerun}"
    if not logged:
        return False, done, "started, no step logged yet"
    if checkpoints_gone(run_dir):
        return False, done, (f"logged to step {logged} of {steps}, but no checkpoint is left: it cannot resume "
                             f"(restore a checkpoint, or start it over with {start_over})")
    return False, done, f"logged to step {logged} of {steps}, no checkpoint yet (a resume starts it again)"


def study_status(study: Study, arms: list[str] | None = None, seeds: list[int] | None = None) -> list[str]:
    """One line per selected run: what is on disk (`run_state`); then the totals."""
    lines, complete = [], 0
    for arm, seed in _selected_runs(study, arms, seeds):
        finished, _, state = run_state(study.run_dir(arm, seed), study.config(arm, seed).train.steps,
                                       study.start_over(arm, seed))
        complete += finished
        lines.append(f"{arm.name} seed {seed}: {state}")
    return lines + [f"{complete} of {len(lines)} runs complete"]


def run_study(study: Study, arms: list[str] | None = None, seeds: list[int] | None = None,
              log: Callable[[str], None] = print, overwrite: bool = False) -> str | None:
    """Train every selected (arm, seed) run that has not reached its last step, resuming from its checkpoint; with
    `overwrite`, every selected run starts over (what it holds is deleted, complete runs' too). A SIGINT/SIGTERM
    stops the whole study once the current run has checkpointed; returns that signal's name (None when every run
    ended by itself)."""
    for arm, seed in _selected_runs(study, arms, seeds):
        stopped_by = _train_run(study, arm, seed, log, overwrite)
        if stopped_by:
            return stopped_by
    return None


def _selected_runs(study: Study, arms: list[str] | None, seeds: list[int] | None) -> list[tuple[Arm, int]]:
    """(arm, seed) pairs in the study's order, arm by arm; every requested seed must belong to a selected arm."""
    selected = [study.arm(a) for a in arms] if arms else list(study.arms)
    known = {s for arm in selected for s in arm.seeds}
    unknown = sorted(set(seeds or ()) - known)
    if unknown:
        raise ConfigError(f"--seeds {' '.join(map(str, unknown))}: no selected arm of {study.path} has "
                          f"{'that seed' if len(unknown) == 1 else 'those seeds'} (its seeds: "
                          f"{', '.join(map(str, sorted(known)))})")
    return [(arm, seed) for arm in selected for seed in arm.seeds if not seeds or seed in seeds]


def _train_run(study: Study, arm: Arm, seed: int, log: Callable[[str], None], overwrite: bool) -> str | None:
    """Train one run to its last step (skipped when complete, unless `overwrite` starts it over), evaluating before
    training on a fresh start; returns the signal's name if one stopped it."""
    from exgrpo.training.launch import prepared_run

    config = study.config(arm, seed)
    complete, done, state = run_state(study.run_dir(arm, seed), config.train.steps)
    if complete and not overwrite:
        log(f"{arm.name} seed {seed}: {state}, skipped")
        return None
    if overwrite:
        config = replace(config, logging=replace(config.logging, overwrite=True))

    def note(message: str) -> None:
        log(f"{arm.name} seed {seed}: {message}")

    start_over = study.start_over(arm, seed)
    with prepared_run(config, resume=not overwrite, log=note, start_over=start_over) as (run, checkpoint):
        note(f"resuming at step {done}" if checkpoint else "starting over" if overwrite else "starting")
        if checkpoint is not None:
            run.trainer.resume(checkpoint, verified=True)
        initial = study.initial_eval_path(config)
        if checkpoint is None and not initial.exists():
            accuracy = run.trainer.evaluate()
            summary = {"accuracy": accuracy.mean, "stderr": accuracy.stderr,
                       "num_questions": accuracy.num_questions,
                       "samples_per_question": accuracy.samples_per_question}
            write_text_atomic(initial, json.dumps(summary))
            note(f"before training {accuracy}")
        run.trainer.train()
        return run.trainer.stopped_by


@dataclass
class RunResult:
    arm: Arm
    seed: int
    config: ExGRPOConfig
    history: list[dict]  # metrics.jsonl lines, one per step
    initial: dict  # before-training evaluation
    samples: list[dict] = field(default_factory=list)  # samples.jsonl lines (logging.sample_every)

    def evaluations(self) -> list[tuple[int, float]]:
        """(step, held-out accuracy), step 0 first."""
        return [(0, self.initial["accuracy"])] + [(m["step"], m["eval/accuracy"]) for m in self.history
                                                  if "eval/accuracy" in m]

    @property
    def final_accuracy(self) -> float:
        return self.evaluations()[-1][1]

    def fresh_rollouts(self) -> list[int]:
        """Cumulative sampled completions after each step: `generation/rollouts` (every generation round), or for
        runs logged before it, B·K minus the replayed members (which are not sampled)."""
        per_step = self.config.train.prompts_per_step * self.config.rollout.num_generations
        total, out = 0, []
        for m in self.history:
            total += int(m.get("generation/rollouts", per_step - m["experience/replayed"]))
            out.append(total)
        return out

    def curve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, cumulative sampled rollouts, held-out accuracy) at each evaluation, step 0 first."""
        sampled = [0] + self.fresh_rollouts()
        steps = np.array([s for s, _ in self.evaluations()])
        return steps, np.array([sampled[s] for s in steps]), np.array([a for _, a in self.evaluations()])

    def primary(self, registered: Registration) -> float:
        """The registered primary metric: the last evaluation, or the mean over the last `late_evaluations`."""
        return float(registered.primary_points(self.curve()[2]).mean())

    def primary_at_rollouts(self, registered: Registration, rollouts: np.ndarray) -> float:
        """The primary metric of this run read at another run's evaluation rollouts (the last one, or the last
        `late_evaluations`), each by linear interpolation between this run's evaluations; NaN where this run
        sampled fewer rollouts in all than asked for (no extrapolation)."""
        _, sampled, accuracy = self.curve()
        points = registered.primary_points(rollouts)
        if points.max() > sampled[-1]:
            return float("nan")
        return float(np.interp(points, sampled, accuracy).mean())


def read_run(study: Study, arm: Arm, seed: int, config: ExGRPOConfig) -> RunResult:
    """What one run of the study (its `config`: `study.config(arm, seed)`) logged, as far as it got, and its
    before-training evaluation."""
    from exgrpo.runtime.tracking import read_metrics

    run_dir = study.run_dir(arm, seed)
    history = read_metrics(run_dir / "metrics.jsonl")
    samples = read_metrics(run_dir / "samples.jsonl") if (run_dir / "samples.jsonl").exists() else []
    return RunResult(arm, seed, config, history, json.loads(study.initial_eval_path(config).read_text()), samples)


def load_results(study: Study, arms: list[str] | None = None, seeds: list[int] | None = None) -> list[RunResult]:
    """Every run of the study (or of the named arms and seeds); incomplete or missing runs are named in the error."""
    results, missing = [], []
    for arm, seed in _selected_runs(study, arms, seeds):
        config = study.config(arm, seed)
        if not run_complete(study.run_dir(arm, seed), config.train.steps) or \
                not study.initial_eval_path(config).exists():
            missing.append(f"{arm.name}/seed-{seed}")
            continue
        results.append(read_run(study, arm, seed, config))
    if missing:
        raise ConfigError(f"{study.path}: runs not complete yet: {', '.join(missing)} "
                          f"(run `exgrpo experiment run {study.path}`)")
    return results
