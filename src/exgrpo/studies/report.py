"""The report of a multi-seed study (exgrpo.studies.study): PNG plots and markdown tables, mean ± std over seeds."""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from exgrpo.config import ConfigError, DataConfig  # noqa: E402
from exgrpo.errors import ExgrpoWarning  # noqa: E402
from exgrpo.runtime.provenance import code_label, read_sessions  # noqa: E402
from exgrpo.studies.criteria import medium_questions  # noqa: E402
from exgrpo.studies.study import Registration, RunResult, Study, load_results  # noqa: E402
from exgrpo.training.history import mixed_phase_start  # noqa: E402
from exgrpo.studies.statistics import paired_difference, power_statement, t_interval, verdict  # noqa: E402
from exgrpo.studies.working import classify  # noqa: E402


def _by_arm(results: list[RunResult]) -> dict[str, list[RunResult]]:
    arms: dict[str, list[RunResult]] = defaultdict(list)
    for r in results:
        arms[r.arm.name].append(r)
    return arms


def _aligned(curves: list[list[tuple[float, float]]], carry: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x grid, (runs, len(grid)) values) of per-run (x, y) curves, x ascending, on the union of their x.

    Runs may end at different steps (every training question retired). With `carry` (held-out accuracy: a
    finished run's policy no longer changes) a run is interpolated linearly between its points and keeps its last
    value after them; otherwise (training metrics) it is NaN wherever it has no point.
    """
    grid = np.array(sorted({x for c in curves for x, _ in c}))
    rows = []
    for curve in curves:
        if carry:
            rows.append(np.interp(grid, [x for x, _ in curve], [y for _, y in curve]))
        else:
            at = dict(curve)
            rows.append(np.array([at.get(x, np.nan) for x in grid], dtype=float))
    return grid, np.array(rows)


def _band(ax, x, rows: np.ndarray, label):
    """Mean ± std over runs (NaN entries left out)."""
    present = (~np.isnan(rows)).sum(0)
    mean = np.where(present > 0, np.nansum(rows, 0) / np.maximum(present, 1), np.nan)
    std = np.array([np.nanstd(col, ddof=1) if n > 1 else 0.0 for col, n in zip(rows.T, present)])
    ax.plot(x, mean, marker="o", markersize=3, label=f"{label} (n={len(rows)})")
    ax.fill_between(x, mean - std, mean + std, alpha=0.2)


def _series(runs: list[RunResult], key: str, default: float = np.nan) -> tuple[np.ndarray, np.ndarray]:
    """A per-step metric of each run on the steps of the longest (NaN after a run's last step)."""
    return _aligned([[(m["step"], m.get(key, default)) for m in r.history] for r in runs], carry=False)


def _legend(ax, **style) -> None:
    """The axes' legend, when something on them has a label (a panel with nothing to show, such as the paired
    difference of a study with one arm, has none; matplotlib would warn)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**style)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _curves(arms: dict[str, list[RunResult]], names: list[str], out: Path, stem: str) -> list[str]:
    """Held-out accuracy vs step and vs rollouts consumed; training reward, entropy, gradient norm, length."""
    fig, (by_step, by_rollouts, paired) = plt.subplots(1, 3, figsize=(15, 3.6))
    base = {r.seed: r for r in arms[names[0]]}
    for name in names:
        runs = arms[name]
        label = runs[0].arm.label
        _band(by_step, *_aligned([r.evaluations() for r in runs], carry=True), label)
        sampled = [[0] + r.fresh_rollouts() for r in runs]
        _band(by_rollouts, *_aligned([[(n[s], a) for s, a in r.evaluations()] for r, n in zip(runs, sampled)],
                                     carry=True), label)
        if name != names[0]:  # per seed: this arm minus the first arm
            for r in (r for r in runs if r.seed in base):
                grid, (mine, theirs) = _aligned([r.evaluations(), base[r.seed].evaluations()], carry=True)
                paired.plot(grid, mine - theirs, marker="o", markersize=3, alpha=0.8, label=f"{label}, seed {r.seed}")
    paired.axhline(0, color="black", linewidth=0.8)
    paired.set(xlabel="step", title=f"Paired difference to {arms[names[0]][0].arm.label} (per seed)")
    by_step.set(xlabel="step", ylabel="held-out accuracy (avg@k)", title="Held-out accuracy vs step")
    by_rollouts.set(xlabel="sampled completions (cumulative)", title="… vs rollouts consumed")
    for ax in (by_step, by_rollouts, paired):
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7)
    _save(fig, out / f"{stem}_heldout.png")

    panels = [("reward", "training reward (batch mean)"), ("entropy", "token entropy"),
              ("grad_norm", "gradient norm"), ("completions/mean_length", "completion length (tokens)")]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    for ax, (key, title) in zip(axes, panels):
        for name in names:
            steps, rows = _series(arms[name], key)
            _band(ax, steps, rows, arms[name][0].arm.label)
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
    _legend(axes[0], fontsize=7)
    _save(fig, out / f"{stem}_training.png")
    return [f"{stem}_heldout.png", f"{stem}_training.png"]


def _buffer(runs: list[RunResult], out: Path, stem: str) -> str:
    """Bucket histogram over time (seed mean), retired questions, replay fraction, importance ratios."""
    K = runs[0].config.rollout.num_generations
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    steps, _ = _series(runs, "step")
    hist = np.array([np.nanmean(_series(runs, f"experience/bucket_{k}", default=0.0)[1], 0) for k in range(K + 1)])
    present = [k for k in range(K + 1) if hist[k].any()]
    if present:  # an arm without experience (GRPO) has an empty buffer
        axes[0].stackplot(steps, *[hist[k] for k in present], labels=[f"k={k}" for k in present])
        _legend(axes[0], fontsize=6, ncol=2, loc="upper left")
    axes[0].set(xlabel="step", title="buffer questions per bucket k")
    for ax, key, title in ((axes[1], "experience/retired", "retired questions (K/K)"),
                           (axes[2], "experience/replay_fraction", "replayed questions / batch")):
        _band(ax, *_series(runs, key), runs[0].arm.label)
        ax.set(xlabel="step", title=title)
    for key, label in (("replay/ratio_mean", "w = π/π_old (mean)"), ("replay/ratio_max", "w (max)"),
                       ("replay/shaped_weight_mean", "shaped f(w) (mean)")):
        steps_k, rows = _series(runs, key)
        _band(axes[3], steps_k, rows, label)
    axes[3].set(xlabel="step", title="replayed tokens: importance weights")
    _legend(axes[3], fontsize=6)
    for ax in axes:
        ax.grid(alpha=0.3)
    _save(fig, out / f"{stem}_buffer.png")
    return f"{stem}_buffer.png"


def _analyses(arms: dict[str, list[RunResult]], names: list[str], out: Path, stem: str) -> str:
    """Coverage, zero-variance share and the entropy of replayed vs fresh correct trajectories over steps."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
    for name in names:
        label = arms[name][0].arm.label
        for ax, key in ((axes[0], "coverage/ever_correct"), (axes[1], "generation/zero_variance_fraction")):
            _band(ax, *_series(arms[name], key), label)
        for key, kind in (("entropy/fresh_correct", "fresh correct"), ("entropy/replayed", "replayed")):
            steps, rows = _series(arms[name], key)
            logged = ~np.isnan(rows).all(0)  # steps where some seed logged it (replays start with the mixed phase)
            if logged.any():
                axes[2].plot(steps[logged], np.nanmean(rows[:, logged], 0), marker="o", markersize=2,
                             label=f"{label}: {kind}")
    titles = ("training questions ever solved (coverage)", "zero-variance groups / groups rolled out",
              "token entropy of correct trajectories (seed mean)")
    for ax, title in zip(axes, titles):
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=6)
    _save(fig, out / f"{stem}_analyses.png")
    return f"{stem}_analyses.png"


def _final_bars(arms: dict[str, list[RunResult]], names: list[str], out: Path, stem: str) -> str:
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 3.4))
    for i, name in enumerate(names):
        finals = [r.final_accuracy for r in arms[name]]
        ax.bar(i, np.mean(finals), yerr=np.std(finals, ddof=1) if len(finals) > 1 else 0, alpha=0.6, capsize=4)
        ax.scatter([i] * len(finals), finals, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(names)), [arms[n][0].arm.label for n in names], rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="final held-out accuracy", title="Final held-out accuracy (bars: mean ± std; dots: seeds)")
    ax.grid(alpha=0.3, axis="y")
    _save(fig, out / f"{stem}_final.png")
    return f"{stem}_final.png"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _paired_delta(runs: list[RunResult], reference: list[RunResult]) -> str:
    """Final accuracy minus the reference arm's on the same seed, mean ± std over the seeds both have."""
    diffs = paired_difference(runs, reference, Registration(primary="final")).at_equal_steps
    if runs[0].arm == reference[0].arm or not len(diffs):
        return "—"
    return f"{100 * diffs.mean():+.1f} ± {100 * diffs.std(ddof=1):.1f}" if len(diffs) > 1 else \
        f"{100 * diffs.mean():+.1f}"


def _interval_text(values: np.ndarray) -> str:
    mean, low, high = t_interval(values)
    return f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def _difference_cells(values: np.ndarray, registered: Registration) -> str:
    """Mean [95% CI] | per seed | verdict; dashes where the reference could not be read (NaN)."""
    if np.isnan(values).any():
        return "— | — | — (the reference sampled fewer rollouts in all)"
    return (f"{_interval_text(values)} | {' / '.join(f'{100 * x:+.1f}' for x in values)} | "
            f"{verdict(values, registered)}")


def paired_table(arms: dict[str, list[RunResult]], comparisons: list[tuple[str, str]],
                 registered: Registration) -> list[str]:
    """Per (arm, reference) comparison: the paired difference of the registered primary metric at equal steps
    and at equal rollouts (mean and 95% t-interval over seeds, accuracy points), per seed, and the registered
    verdict on each. Where some runs of a replaying arm never entered the mixed phase (no success to store: each
    is its reference's run until then), a second row leaves those seeds out (descriptive)."""
    lines = ["| comparison | seeds | Δ at equal steps: mean [95% CI] | per seed | verdict | Δ at equal rollouts: "
             "mean [95% CI] | per seed | verdict |", "|---|---|---:|---|---|---:|---|---|"]
    for name, reference in comparisons:
        runs, label = arms[name], f"{arms[name][0].arm.label} − {arms[reference][0].arm.label}"
        replayed = [r for r in runs if r.config.experience.ratio == 0 or mixed_phase_start(r.history) is not None]
        subsets = [(runs, label)]
        if len(replayed) < len(runs):
            subsets.append((replayed, f"{label}, seeds where it replayed"))
        for subset, row in subsets:
            d = paired_difference(subset, arms[reference], registered)
            if len(d.seeds) >= 2:
                lines.append(f"| {row} | {', '.join(map(str, d.seeds))} | "
                             f"{_difference_cells(d.at_equal_steps, registered)} | "
                             f"{_difference_cells(d.at_equal_rollouts, registered)} |")
    return lines


def _primary_text(registered: Registration) -> str:
    return ("the last held-out evaluation" if registered.primary == "final" else
            f"the mean held-out accuracy over the last {registered.late_evaluations} evaluations")


def write_curves(arms: dict[str, list[RunResult]], path: Path, sessions: dict[str, list[dict]]) -> None:
    """Every run's evaluations (step, cumulative sampled rollouts, accuracy) as JSON under "<arm>/seed-<seed>", kept
    with the report so that it can be analysed again after the run directories are gone, and under "provenance"
    each run's recorded sessions (`exgrpo.runtime.provenance`)."""
    curves = {f"{name}/seed-{r.seed}": [[int(s), int(n), float(a)] for s, n, a in zip(*r.curve())]
              for name, runs in arms.items() for r in runs}
    path.write_text(json.dumps({**curves, "provenance": sessions}, indent=0))


NOT_RECORDED = "not recorded"


def run_sessions(study: Study, arms: dict[str, list[RunResult]]) -> dict[str, list[dict]]:
    """Each run's recorded sessions (started, ended, the code), by "<arm>/seed-<seed>"."""
    return {f"{name}/seed-{r.seed}": read_sessions(study.run_dir(r.arm, r.seed)) for name, runs in arms.items()
            for r in runs}


def _runs_by_code(sessions: dict[str, list[dict]]) -> dict[str, list[str]]:
    """The runs each code ran or resumed (`code_label`), "not recorded" for runs that recorded no session."""
    by_code: dict[str, list[str]] = defaultdict(list)
    for run, recorded in sessions.items():
        for label in dict.fromkeys(code_label(s["code"]) for s in recorded) or [NOT_RECORDED]:
            by_code[label].append(run)
    return dict(by_code)


def code_warning(sessions: dict[str, list[dict]]) -> str | None:
    """What is wrong with the code that ran the study's runs, or None: runs run or resumed by different code
    (or some recorded and some not), or run from a tree with uncommitted changes. Runs that all recorded nothing
    are not warned about here (the provenance table says so)."""
    by_code = _runs_by_code(sessions)
    dirty = any(label.endswith("(dirty tree)") for label in by_code)
    if list(by_code) == [NOT_RECORDED] or (len(by_code) == 1 and not dirty):
        return None
    what = ("were run or resumed by different code" if len(by_code) > 1 else
            "were run from a tree with uncommitted changes, so which code ran them is not known exactly")
    return f"the runs of this study {what}: " + "; ".join(f"{label}: {', '.join(runs)}"
                                                         for label, runs in by_code.items())


def zero_advantage_steps(run: RunResult) -> int | None:
    """The run's optimizer steps whose mini-batch had every advantage 0 (the logged `zero_advantage_steps`); for
    lines logged before that metric, the steps with no reward spread in any group when a step is one optimizer step
    (train.mini_batches 1); None when neither tells."""
    total = 0.0
    for m in run.history:
        if "zero_advantage_steps" in m:
            total += m["zero_advantage_steps"]
        elif run.config.train.mini_batches == 1:
            total += m["frac_reward_zero_std"] == 1.0
        else:
            return None
    return int(total)


def provenance_table(arms: dict[str, list[RunResult]], names: list[str], sessions: dict[str, list[dict]]
                     ) -> list[str]:
    """One row per run: its sessions (a start and every resume), when the first started and the last ended, the
    code of each, and its optimizer steps whose advantages were all 0: applied on the entropy bonus alone, or skipped
    (`train.zero_advantage_steps` skip)."""
    lines = ["| run | sessions | started | ended | code | optimizer steps with every advantage 0 |",
             "|---|---:|---|---|---|---:|"]
    for name in names:
        for r in arms[name]:
            recorded = sessions[f"{name}/seed-{r.seed}"]
            zero = zero_advantage_steps(r)
            fate = "skipped" if r.config.train.zero_advantage_steps == "skip" else "applied"
            ended = (recorded[-1]["ended"] or "no end recorded (killed or crashed)") if recorded else NOT_RECORDED
            started = recorded[0]["started"] if recorded else NOT_RECORDED
            code = " / ".join(dict.fromkeys(code_label(s["code"]) for s in recorded)) or NOT_RECORDED
            lines.append(f"| {name}/seed-{r.seed} | {len(recorded)} | {started} | {ended} | {code} | "
                         f"{'—' if zero is None else f'{zero} {fate}'} |")
    return lines


def provenance_summary(sessions: dict[str, list[dict]], warning: str | None) -> str:
    """The line above the provenance table: the warning, or which one code ran every run, or that none recorded it."""
    if warning:
        return f"**WARNING: {warning}.**"
    (label,) = _runs_by_code(sessions)
    if label == NOT_RECORDED:
        return "No run recorded its sessions (they ran before run directories recorded them): which code ran them is " \
            "unknown."
    return f"Every run was run and resumed by the same code: {label}."


def analyses_table(arms: dict[str, list[RunResult]], names: list[str]) -> list[str]:
    """Per arm (mean over seeds): steps run (fewer than train.steps when every question retired), rollouts sampled,
    coverage, zero-variance share, entropies of correct trajectories (mean over the steps that have both)."""
    lines = ["| arm | steps run | rollouts sampled | training questions ever solved | zero-variance groups | "
             "entropy: replayed | entropy: fresh correct (same steps) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        runs = arms[name]
        both = [m for r in runs for m in r.history if "entropy/replayed" in m and "entropy/fresh_correct" in m]
        fresh = both or [m for r in runs for m in r.history if "entropy/fresh_correct" in m]

        def mean_of(key, rows):
            return f"{np.mean([m[key] for m in rows]):.3f}" if rows else "—"

        zero = [m["generation/zero_variance_fraction"] for r in runs for m in r.history
                if "generation/zero_variance_fraction" in m]
        lines.append(f"| {runs[0].arm.label} | {np.mean([r.history[-1]['step'] for r in runs]):.1f} | "
                     f"{np.mean([r.fresh_rollouts()[-1] for r in runs]):.0f} | "
                     f"{np.mean([r.history[-1].get('coverage/ever_correct', np.nan) for r in runs]):.1f} | "
                     + (f"{100 * np.mean(zero):.1f}%" if zero else "—") + " | "
                     f"{mean_of('entropy/replayed', both)} | {mean_of('entropy/fresh_correct', fresh)} |")
    return lines


def final_table(arms: dict[str, list[RunResult]], names: list[str], references: list[str]) -> list[str]:
    """One row per arm: start, final and mean-over-evaluations accuracy (mean ± std over seeds, standard error of the
    mean), paired differences to the reference arms, training time."""
    lines = ["| arm | seeds | before | final: mean ± std (SE) | per seed | mean of evals after step 0 | "
             + " | ".join(f"Δ final vs {arms[n][0].arm.label} (paired)" for n in references)
             + " | training time / run |",
             "|---|---|---:|---:|---|---:|" + "---:|" * len(references) + "---:|"]
    for name in names:
        runs = arms[name]
        finals = np.array([r.final_accuracy for r in runs])
        curve = all(len(r.evaluations()) > 2 for r in runs)  # arms evaluated only at the end have no mean
        auc = np.array([np.mean([a for _, a in r.evaluations()[1:]]) for r in runs])
        std = finals.std(ddof=1) if len(runs) > 1 else 0.0
        auc_std = auc.std(ddof=1) if len(runs) > 1 else 0.0
        train_minutes = np.mean([sum(m["time/step"] for m in r.history) for r in runs]) / 60
        lines.append(
            f"| {runs[0].arm.label} | {', '.join(str(r.seed) for r in runs)} | "
            f"{_pct(np.mean([r.initial['accuracy'] for r in runs]))} | {_pct(finals.mean())} ± {_pct(std)} "
            f"({_pct(std / np.sqrt(len(runs)))}) | {' / '.join(_pct(f) for f in finals)} | "
            + (f"{_pct(auc.mean())} ± {_pct(auc_std)}" if curve else "—") + " | "
            + " | ".join(_paired_delta(runs, arms[n]) for n in references) + f" | {train_minutes:.1f} min |")
    return lines


def medium_bucket_supply(history: list[dict], num_generations: int) -> tuple[float, float] | None:
    """Over the steps that replayed: the mean number of buffer questions in the medium buckets (k = 2..K-2) when the
    step drew its replays (the previous step's logged buckets), and the share of replay slots they could fill,
    min(medium, replayed) / replayed. The sampler almost never draws k = 1 or K-1 while medium questions exist
    (docs/results.md, round four's third pilot). None when nothing was replayed."""
    medium, filled = [], []
    for before, row in zip(history, history[1:]):
        replayed = row.get("experience/replayed", 0)
        if replayed:
            medium.append(medium_questions(before, num_generations))
            filled.append(min(medium[-1], replayed) / replayed)
    return (float(np.mean(medium)), float(np.mean(filled))) if medium else None


def buffer_table(arms: dict[str, list[RunResult]], names: list[str]) -> list[str]:
    """Per arm at the end of training (mean over seeds): buffer, retirement, replays, importance weights; and over
    the steps that replayed, what the medium buckets held (`medium_bucket_supply`)."""
    lines = ["| arm | mixed from step | replayed questions | buffer questions | trajectories | retired | "
             "replay w mean [min, max] | f(w) mean | medium-bucket questions / replaying step | replay slots "
             "they could fill |", "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name in names:
        runs = arms[name]
        switched = [s for s in map(mixed_phase_start, (r.history for r in runs)) if s is not None]
        last = [r.history[-1] for r in runs]

        def avg(key, rows=None):
            return np.nanmean([m.get(key, np.nan) for m in (rows or last)])

        replay_rows = [m for r in runs for m in r.history if "replay/ratio_mean" in m]
        weights = "—" if not replay_rows else (
            f"{avg('replay/ratio_mean', replay_rows):.3f} [{min(m['replay/ratio_min'] for m in replay_rows):.3f}, "
            f"{max(m['replay/ratio_max'] for m in replay_rows):.3f}]")
        shaped = "—" if not replay_rows else f"{avg('replay/shaped_weight_mean', replay_rows):.3f}"
        replayed = np.mean([sum(m["experience/replayed"] for m in r.history) for r in runs])
        switch = f"{np.mean(switched):.1f}" if switched else "—"
        supply = [x for r in runs if (x := medium_bucket_supply(r.history, r.config.rollout.num_generations))]
        medium = f"{np.mean([m for m, _ in supply]):.1f} | {100 * np.mean([f for _, f in supply]):.0f}%" \
            if supply else "— | —"
        lines.append(f"| {runs[0].arm.label} | {switch} | {replayed:.1f} | "
                     f"{avg('experience/questions'):.1f} | {avg('experience/trajectories'):.1f} | "
                     f"{avg('experience/retired'):.1f} | {weights} | {shaped} | {medium} |")
    return lines


def take_off_line(arms: dict[str, list[RunResult]], names: list[str], registered: Registration,
                  gain: float = 0.05) -> str:
    """The take-off count, a secondary: per arm, the runs whose registered primary metric is at least `gain` above
    their own step-0 evaluation."""
    counts = [f"{arms[n][0].arm.label} {sum(r.primary(registered) - r.curve()[2][0] >= gain for r in arms[n])} of "
              f"{len(arms[n])}" for n in names]
    return (f"Runs whose primary metric is at least {100 * gain:.0f} points above their step 0 (take-off): "
            + "; ".join(counts) + ".")


def mechanism_table(arms: dict[str, list[RunResult]], names: list[str]) -> list[str]:
    """Why a verdict came out as it did, per arm (mean over seeds): the first step with a correct rollout of the
    policy's own (over the runs that had one, counted when some had none), replayed questions per step,
    zero-variance groups, and the logged samples that were paid (reward at the success threshold), fresh and
    replayed, read by `exgrpo.studies.working.classify`: valid working, lucky (right answer, a wrong step) or no
    working."""
    lines = ["| arm | first success step | replays / step | zero-variance groups | paid fresh samples: valid / "
             "lucky / no working | paid replayed samples: valid / lucky / no working |",
             "|---|---:|---:|---:|---|---|"]
    for name in names:
        runs = arms[name]
        first = [next((m["step"] for m in r.history if "entropy/fresh_correct" in m), np.nan) for r in runs]
        replays = np.mean([m["experience/replayed"] for r in runs for m in r.history])
        zero = [m["generation/zero_variance_fraction"] for r in runs for m in r.history
                if "generation/zero_variance_fraction" in m]
        paid = {replayed: [s for r in runs for s in r.samples if s["replayed"] == replayed
                           and s["reward"] >= r.config.reward.success_threshold] for replayed in (False, True)}

        def classes(samples: list[dict]) -> str:
            counts = Counter(classify(s["completion"]) for s in samples)
            return f"{len(samples)}: {counts['valid']} / {counts['lucky']} / {counts['no_working']}"

        succeeded = int(np.sum(~np.isnan(first)))
        first_step = "—" if not succeeded else f"{np.nanmean(first):.1f}" + \
            (f" ({succeeded} of {len(runs)} runs)" if succeeded < len(runs) else "")
        lines.append(f"| {runs[0].arm.label} | {first_step} | "
                     f"{replays:.2f} | " + (f"{100 * np.mean(zero):.1f}%" if zero else "—")
                     + f" | {classes(paid[False])} | {classes(paid[True])} |")
    return lines


SAMPLES_PAGE = "samples.md"


def _states(completion: str, answer: str) -> bool:
    """Whether `answer` appears in `completion` as a whole number or word (not inside a longer one)."""
    return re.search(rf"(?<![\w.]){re.escape(answer)}(?![\w]|\.\d)", completion) is not None


def samples_to_read(arms: dict[str, list[RunResult]], names: list[str], questions: dict[str, str]) -> list[str]:
    """A page for reading what each run was paid for by hand: every logged sample that was paid, and every unpaid one
    that states its gold answer somewhere (a possible miss of the reward), with its question (`questions`: id → the
    prompt's last user message), gold answer and `classify`'s reading of its working (samples logged without the
    `truncated` field read "not paid" whether cut or not)."""
    lines = ["# Logged samples to read", "",
             "Every logged sample that was paid, and every unpaid one whose completion states its gold answer "
             "somewhere; the working's class is `exgrpo.studies.working.classify`'s.", ""]
    for name in names:
        for run in arms[name]:
            threshold = run.config.reward.success_threshold
            lines += [f"## {run.arm.label}, seed {run.seed}: {sum(s['reward'] >= threshold for s in run.samples)} "
                      f"paid of {len(run.samples)} logged", ""]
            for s in run.samples:
                paid = s["reward"] >= threshold
                if not paid and not _states(s["completion"], s["answer"]):
                    continue
                question = " ".join(questions.get(s["question_id"], s["question_id"]).split())
                reading = f"paid, {classify(s['completion']).replace('_', ' ')}" if paid else \
                    "not paid, cut at the length cap" if s.get("truncated") else "not paid"
                lines += [f"**step {s['step']}{', replayed' if s['replayed'] else ''}: {reading}.** {question} "
                          f"Gold: {s['answer']}.", "", *[f"> {line}" for line in s["completion"].splitlines() or [""]],
                          ""]
    return lines


def question_texts(data_configs: list[DataConfig]) -> dict[str, str]:
    """id → last user message (prompt suffix included) of every question these data configs train on, each data set
    read once."""
    from exgrpo.data import load_questions

    texts, read = {}, set()
    for d in data_configs:
        key = (d.train, d.split, d.limit, d.skip_invalid, d.prompt_suffix)
        if key not in read:
            read.add(key)
            for q in load_questions(d.train, split=d.split, limit=d.limit, skip_invalid=d.skip_invalid,
                                    prompt_suffix=d.prompt_suffix):
                texts[q.id] = q.messages[-1]["content"]
    return texts


def _write_samples_page(arms: dict[str, list[RunResult]], names: list[str], out: Path) -> list[str]:
    """Writes `samples_to_read` to `out` when any run logged samples (else removes an earlier report's page); returns
    the report's lines linking to it."""
    logged = [r for n in names for r in arms[n] if r.samples]
    if not logged:
        (out / SAMPLES_PAGE).unlink(missing_ok=True)
        return []
    questions = question_texts([r.config.data for r in logged])
    (out / SAMPLES_PAGE).write_text("\n".join(samples_to_read(arms, names, questions)))
    return [f"Every paid logged sample, with its question, for reading by hand: [{SAMPLES_PAGE}]({SAMPLES_PAGE}).", ""]


def _plots(arms: dict, names: list[str], main_arms: list[str], ablations: list[str], out: Path) -> list[str]:
    """The report's figures, written to `out`: the main arms' curves, the buffer and analyses of the last main arm,
    the ablations' curves against it, and every arm's final accuracy. Returns their file names."""
    plots = _curves(arms, main_arms, out, "main")
    plots.append(_buffer(arms[main_arms[-1]], out, "main"))
    plots.append(_analyses(arms, main_arms, out, "main"))
    if ablations:
        plots += _curves(arms, [main_arms[-1], *ablations], out, "ablations")
    plots.append(_final_bars(arms, names, out, "all"))
    return plots


def _setting(study: Study, arms: dict[str, list[RunResult]]) -> str:
    """The report's opening sentence: what a run is and how held-out accuracy is measured."""
    c = next(iter(arms.values()))[0].config
    rows = {r.seed: r.initial["num_questions"] for runs in arms.values() for r in runs}
    held_out = ", ".join(f"seed {seed}: {n}" for seed, n in sorted(rows.items()))
    return (f"Base config `{study.base.name}`, {c.train.steps} steps × {c.train.prompts_per_step} questions × "
            f"K = {c.rollout.num_generations}; held-out accuracy = avg@{c.eval.samples} at temperature "
            f"{c.eval.temperature} over each seed's held-out rows ({held_out}); ± is the std over seeds, "
            "SE = std / √seeds.")


def _verdict_rules(reg: Registration) -> str:
    """How the paired differences are computed and judged, as registered."""
    return (f"The registered primary metric: {_primary_text(reg)}. Equal rollouts: the reference arm's accuracy read "
            "at the arm's cumulative sampled rollouts of those evaluations, by linear interpolation between the "
            f"reference's own evaluations. Verdict (registered): {_helps_text(reg)}, \"hurts\" mirrored, \"no "
            f"difference\" when the interval lies within ±{100 * reg.equivalence:.1f}; the registration says which "
            "difference is primary.")


def _helps_text(reg: Registration) -> str:
    if reg.verdict_rule == "interval":
        return ("\"helps\" when the 95% interval is above 0, whatever the mean (its size is read against "
                f"{100 * reg.effect:+.1f})")
    return f"\"helps\" when the mean is ≥ {100 * reg.effect:+.1f} and the 95% interval is above 0"


def _power_statements(arms: dict[str, list[RunResult]], comparisons: list[tuple[str, str]],
                      registered: Registration) -> list[str]:
    """The registered power at each comparison's number of paired seeds (arms may have run different seeds)."""
    by_seeds: dict[int, list[str]] = defaultdict(list)
    for name, reference in comparisons:
        shared = {r.seed for r in arms[name]} & {r.seed for r in arms[reference]}
        by_seeds[len(shared)].append(f"{arms[name][0].arm.label} − {arms[reference][0].arm.label}")
    counts = sorted((n for n in by_seeds if n >= 2), reverse=True)
    if len(counts) == 1:
        return [power_statement(registered, counts[0]), ""]
    return [line for n in counts for line in (f"{'; '.join(by_seeds[n])}: {power_statement(registered, n)}", "")]


def _interim_line(study: Study, seeds: list[int] | None) -> list[str]:
    """Says that a report made with --seeds covers part of the study, and how much."""
    every = sorted({s for arm in study.arms for s in arm.seeds})
    if not seeds or set(every) <= set(seeds):
        return []
    return [f"**Interim report: seeds {', '.join(map(str, sorted(set(seeds))))} only (`--seeds`), "
            f"{len(set(seeds))} of the study's {len(every)}.**", ""]


def _reported_runs(study: Study, names: list[str], seeds: list[int] | None) -> dict[str, list[RunResult]]:
    """The runs of each reported arm (of `seeds` only, for an interim report: each arm must have one of them)."""
    arms = _by_arm(load_results(study, names, seeds))
    for name in names:
        if name not in arms:
            raise ConfigError(f"--seeds {' '.join(map(str, seeds or []))}: arm {name} has none of those seeds "
                              f"(leave it out with --arms)")
    return arms


def write_study_report(study: Study, out: str | Path, main_arms: list[str], only: list[str] | None = None,
                       seeds: list[int] | None = None) -> Path:
    """Plots and tables for all arms (or the arms in `only`, the baseline and `main_arms` among them) over all their
    seeds (or those in `seeds`, an interim report); `main_arms` (e.g. GRPO and ExGRPO) get the curves and the buffer
    plot is drawn for the last of them. Returns the markdown file (report.md in `out`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = [a.name for a in study.arms if not only or a.name in only]
    arms = _reported_runs(study, names, seeds)
    ablations = [n for n in names if n not in main_arms]
    plots = _plots(arms, names, main_arms, ablations, out)
    samples_link = _write_samples_page(arms, names, out)
    sessions = run_sessions(study, {n: arms[n] for n in names})
    warning = code_warning(sessions)
    if warning:
        warnings.warn(ExgrpoWarning(warning), stacklevel=2)
    write_curves(arms, out / "curves.json", sessions)
    reg = study.registered
    references = list(dict.fromkeys([study.baseline, main_arms[-1]]))  # deltas against GRPO and against ExGRPO
    comparisons = [(n, study.baseline) for n in names if n != study.baseline] + \
        [(main_arms[-1], n) for n in ablations if main_arms[-1] != study.baseline]  # what each ablation removes
    lines = [
        f"# Study `{study.path.name}`", "", _setting(study, arms), "", *_interim_line(study, seeds),
        *([f"**WARNING: {warning}** (see Runs, below).", ""] if warning else []),
        "## Final held-out accuracy", "", *final_table(arms, names, references), "",
        "## Paired differences (accuracy points)", "", _verdict_rules(reg), "",
        *(_power_statements(arms, comparisons, reg) if reg.power_sd else []),
        *paired_table(arms, comparisons, reg), "",
        "## Buffer and replay (end of training, mean over seeds)", "", *buffer_table(arms, names), "",
        "## Coverage, zero-variance groups, entropy (mean over seeds)", "", *analyses_table(arms, names), "",
        "## What was paid, and why (mean over seeds; samples: every logged one, counted over seeds)", "",
        *mechanism_table(arms, names), "",
        *samples_link,
        take_off_line(arms, names, reg), "",
        "## Runs: when, which code, optimizer steps without a learning signal", "",
        provenance_summary(sessions, warning), "", *provenance_table(arms, names, sessions), "",
        *[f"![{p}]({p})" for p in plots], "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path

