"""`exgrpo train|demo --config F [section.field=value ...]`."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from rich.console import Console
from rich.table import Table

from exgrpo.config import ConfigError, load_config


def _train(args, overrides) -> int:
    from exgrpo.run import build_run

    config = load_config(args.config, overrides)
    run = build_run(config)
    try:
        run.trainer.train()
    finally:
        run.close()
    return 0


def _demo(args, overrides) -> int:
    """Held-out accuracy before, ExGRPO training, held-out accuracy after, a table and a report."""
    from exgrpo.report import before_after_rows, write_report
    from exgrpo.run import build_run
    from exgrpo.tracking import Tracker

    console = Console()
    start = time.perf_counter()
    config = load_config(args.config, overrides)
    console.print(f"[bold]exgrpo demo[/]: {config.model.name} on {config.data.train}")
    run = build_run(config)
    try:
        console.print(f"evaluating {len(run.holdout)} held-out questions × {config.eval.samples} samples ...")
        before = run.evaluate()
        console.print(f"before training: {before}")
        evaluations = [(0, before)]
        tracker = Tracker(config.logging.output_dir, config.train.steps, tensorboard=config.logging.tensorboard,
                          progress=config.logging.progress, config=config.to_dict())

        def on_step(step: int, metrics: dict) -> None:
            if config.eval.every and step % config.eval.every == 0 and step < config.train.steps:
                acc = run.evaluate(seed_offset=step)
                evaluations.append((step, acc))
                tracker.log(step, {"eval/accuracy": acc.mean, "eval/stderr": acc.stderr})
                tracker.print(f"step {step}: held-out {acc}")

        try:
            history = run.trainer.train(tracker, on_step)
        finally:
            tracker.close()
        after = run.evaluate(seed_offset=len(history))
        evaluations.append((len(history), after))
    finally:
        run.close()
    wall = time.perf_counter() - start
    table = Table(title="ExGRPO demo: held-out sampled accuracy")
    table.add_column("")
    table.add_column("value")
    for a, b in before_after_rows(before, after):
        table.add_row(a, b)
    switch = next((i + 1 for i, m in enumerate(history) if m["phase"] == "mixed"), None)
    table.add_row("steps / mixed phase from", f"{len(history)} / {switch}")
    table.add_row("experiential questions replayed", f"{sum(m['experience/replayed'] for m in history):.0f}")
    table.add_row("wall time (this command)", f"{wall / 60:.1f} min")
    console.print(table)
    command = "exgrpo demo " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    report = write_report(config.logging.output_dir, history, evaluations, before, after, wall, command)
    console.print(f"report: {report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="exgrpo", description="ExGRPO: experience replay for RLVR")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "train with ExGRPO"), ("demo", "before/after evaluation around training")):
        p = sub.add_parser(name, help=help_text,
                           epilog="Any config field can be overridden: section.field=value or --section.field value")
        p.add_argument("--config", help="YAML config file")
    args, overrides = parser.parse_known_args(argv)
    try:
        return {"train": _train, "demo": _demo}[args.command](args, overrides)
    except ConfigError as e:
        print(f"exgrpo: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
