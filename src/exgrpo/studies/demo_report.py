"""A run report: markdown with a before/after table and PNG plots of reward, held-out accuracy and buckets."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from exgrpo.evaluation.heldout import Accuracy  # noqa: E402
from exgrpo.training.history import mixed_phase_start  # noqa: E402


def before_after_rows(before: Accuracy, after: Accuracy) -> list[tuple[str, str]]:
    gain = after.mean - before.mean
    se = (before.stderr**2 + after.stderr**2) ** 0.5
    return [
        ("held-out accuracy before", str(before)),
        ("held-out accuracy after", str(after)),
        ("gain", f"{100 * gain:+.1f} points" + (f" ({gain / se:.1f} standard errors)" if se > 0 else "")),
    ]


def _plot(path: Path, series: dict[str, tuple[list, list]], title: str, ylabel: str, kind: str = "line") -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if kind == "stack" and not series:  # e.g. a buffer that never held a question
        ax.text(0.5, 0.5, "nothing to show", ha="center", va="center", transform=ax.transAxes)
    elif kind == "stack":
        steps = next(iter(series.values()))[0]
        ax.stackplot(steps, *[v for _, v in series.values()], labels=list(series))
    else:
        for label, (x, y) in series.items():
            ax.plot(x, y, marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if series:
        ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run_dir: str | Path, history: list[dict], evaluations: list[tuple[int, float]],
                 before: Accuracy, after: Accuracy, wall_seconds: float, command: str) -> Path:
    run_dir = Path(run_dir)
    steps = list(range(1, len(history) + 1))
    _plot(run_dir / "reward.png", {"batch reward": (steps, [m["reward"] for m in history])},
          "Training reward (batch mean)", "reward")
    _plot(run_dir / "heldout_accuracy.png",
          {"held-out accuracy": ([s for s, _ in evaluations], [a for _, a in evaluations])},
          "Held-out sampled accuracy", "accuracy")
    buckets = sorted({int(k.rsplit("_", 1)[1]) for m in history for k in m if k.startswith("experience/bucket_")})
    _plot(run_dir / "buckets.png",
          {f"k={k}": (steps, [m.get(f"experience/bucket_{k}", 0.0) for m in history]) for k in buckets},
          "Buffer questions per correctness bucket", "questions", kind="stack")
    switch = mixed_phase_start(history)
    replayed = sum(m["experience/replayed"] for m in history)
    lines = [
        "# ExGRPO run report", "", f"Command: `{command}`", "",
        "| | |", "|---|---|", *[f"| {a} | {b} |" for a, b in before_after_rows(before, after)],
        f"| steps | {len(history)} |",
        f"| mixed phase from step | {switch if switch is not None else 'never (threshold not crossed)'} |",
        f"| experiential questions replayed | {replayed:.0f} |",
        f"| buffer at the end | {history[-1]['experience/questions']:.0f} questions, "
        f"{history[-1]['experience/trajectories']:.0f} trajectories, {history[-1]['experience/retired']:.0f} retired |",
        f"| wall time | {wall_seconds / 60:.1f} min |", "",
        "![reward](reward.png)", "![held-out accuracy](heldout_accuracy.png)", "![buckets](buckets.png)", "",
    ]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
