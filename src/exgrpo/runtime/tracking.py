"""Where metrics go: a rich progress bar, a JSONL file, TensorBoard and (when installed) Weights & Biases."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from exgrpo.runtime.atomic import write_text_atomic
from exgrpo.errors import RunDirectoryError, os_cause


#: the run's logs: a line per step (metrics), a few training and held-out completions (samples)
LOG_FILES = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")


class Tracker:
    @classmethod
    def from_config(cls, config, start_step: int = 0) -> "Tracker":
        """The tracker of a run's config (an ExGRPOConfig): its directory, steps and `logging` settings."""
        lg = config.logging
        return cls(lg.output_dir, config.train.steps, tensorboard=lg.tensorboard, wandb=lg.wandb,
                   progress=lg.progress, config=config.to_dict(), start_step=start_step)

    def __init__(self, output_dir: str | Path, total_steps: int, *, tensorboard: bool = True, wandb: bool = False,
                 progress: bool = True, config: dict | None = None, start_step: int = 0):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.console = Console(stderr=True)
        self._jsonl, self._samples, self._eval_samples = ((self.dir / name).open("a") for name in LOG_FILES)
        self._write_failed = False
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run re-logs the steps after its checkpoint: drop TensorBoard's copies of them
            self._tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise RuntimeError("logging.wandb is true but wandb is not installed (pip install wandb)") from None
            self._wandb = wandb_module.init(config=config or {}, dir=str(self.dir))
        self._progress = None
        if progress:
            # Sized for an 80-column terminal at 1000/1000 steps and a buffer in the thousands (75 characters);
            # throughput and stage times are in metrics.jsonl.
            self._progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=10), TextColumn("{task.fields[status]}"),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()

    def log(self, step: int, metrics: dict) -> None:
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self._append(self._jsonl, json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._progress is not None and "reward" in metrics:
            status = (f"reward {metrics['reward']:.2f} {metrics.get('phase', ''):<6} buffer "
                      f"{metrics.get('experience/questions', 0):.0f}q/{metrics.get('experience/trajectories', 0):.0f}t")
            self._progress.update(self._task, completed=step, status=status)

    def log_samples(self, step: int, samples: list[dict], held_out: bool = False) -> None:
        """Example completions of a training step (samples.jsonl), or of the held-out evaluation after it
        (`held_out`: eval_samples.jsonl)."""
        file = self._eval_samples if held_out else self._samples
        self._append(file, "".join(json.dumps({"step": step, **sample}) + "\n" for sample in samples))

    def _append(self, file, text: str) -> None:
        try:
            file.write(text)
            file.flush()
        except OSError as e:
            self._write_failed = True
            raise RunDirectoryError(f"cannot write {file.name}: {os_cause(e)}") from None

    def print(self, *args) -> None:
        self.console.print(*args)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        for file in (self._jsonl, self._samples, self._eval_samples):
            try:
                file.close()
            except OSError:  # what a failed write left in the buffer, already reported by _append
                if not self._write_failed:
                    raise
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


#: metrics renamed, old name -> new: lines a run wrote before (or before its resume) are read under the new name
RENAMED_METRICS = {"batch/solved": "batch/pass_at_1", "coverage/solved": "coverage/ever_correct",
                   "skipped_updates": "skipped_optimizer_steps"}


def read_metrics(path: str | Path) -> list[dict]:
    """The lines of a `metrics.jsonl` (or `samples.jsonl`, `eval_samples.jsonl`), metrics under their current names."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [{RENAMED_METRICS.get(key, key): value for key, value in line.items()} for line in lines]


def truncate_metrics(run_dir: str | Path, step: int) -> None:
    """Drop logged lines of steps after `step` (they are re-run after a resume), atomically.

    A last line cut short by a kill is dropped too; an unreadable line elsewhere is an error naming it.
    """
    for name in LOG_FILES:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = []
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(lines):  # torn by a kill mid-write
                    break
                raise RunDirectoryError(f"{path} line {number} is not JSON: {line[:80]!r}") from None
            if record["step"] <= step:
                kept.append(line)
        write_text_atomic(path, "".join(line + "\n" for line in kept))
