"""`exgrpo train|demo --config PRESET_OR_FILE [section.field=value ...]`, `exgrpo eval --model M --benchmarks B ...`,
`exgrpo experiment run|report STUDY`, `exgrpo export RUN_OR_CHECKPOINT OUT [--merge]`,
`exgrpo buffer RUN_OR_CHECKPOINT [--json]` and `exgrpo serve --config F --port P [-- VLLM_ARGS]`."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import sys
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

from exgrpo import __version__
from exgrpo.config import ConfigError, load_config, preset_names
from exgrpo.errors import ExgrpoError, ExgrpoWarning
from exgrpo.runtime import launched_rank
from exgrpo.runtime.signals import StopNow, sigterm_stops_at_once


def _train(args, overrides) -> int:
    from exgrpo.training.launch import prepared_run
    from exgrpo.training.history import idle_settings

    if args.overwrite:
        overrides = overrides + ["logging.overwrite=true"]
    if args.resume and args.resume != "auto":
        config = _resumed_config(args, overrides)
    elif args.config is None:
        raise ConfigError(f"exgrpo train needs --config: a preset ({', '.join(preset_names())}) or a YAML file "
                          "(or --resume RUN_DIR)")
    else:
        config = load_config(args.config, overrides)
    with prepared_run(config, resume=bool(args.resume), log=_note) as (run, checkpoint):
        if checkpoint is not None:
            run.trainer.resume(checkpoint, verified=True)
            _note(f"resumed from {checkpoint} at step {run.trainer.step}")
        history = run.trainer.train()
    for note in idle_settings(config, history):
        _note(note)
    return _stop_code(run.trainer.stopped_by)


def _resumed_config(args, overrides):
    """The config of `--resume RUN_DIR`: the run's own resolved config (config.json), unless a config file is
    given; overrides apply on top. An error in the stored config names the file."""
    from exgrpo.config import read_run_config

    run_config = Path(args.resume) / "config.json"
    if run_config.is_dir():
        raise ConfigError(f"--resume {args.resume}: {run_config} is a directory; expected the run's config file")
    if not run_config.is_file():
        raise ConfigError(f"--resume {args.resume}: no run there (no {run_config})")
    overrides = overrides + [f"logging.output_dir={args.resume}"]
    if args.config:
        return load_config(args.config, overrides)
    base = read_run_config(run_config)
    if "logging" in base:
        base["logging"].pop("overwrite", None)  # an action its start took (stored by exgrpo before 2026-12)
    try:
        return load_config(None, overrides, base=base)
    except ConfigError as e:
        raise ConfigError(f"{run_config} with the overrides: {e}") from None


def _stop_code(signal_name: str | None) -> int:
    """0 for a run that ended by itself; 128 + the signal's number (the shell's convention) for one asked to stop."""
    return 128 + signal.Signals[signal_name].value if signal_name else 0


def _note(message: str) -> None:
    """A line for the user; under torchrun rank 0 says it for every rank."""
    if launched_rank() == 0:
        print(f"exgrpo: {message}", file=sys.stderr)


def _demo(args, overrides) -> int:
    """Held-out accuracy before, ExGRPO training (with periodic held-out evaluation), after, a table and a report."""
    from exgrpo.studies.demo_report import before_after_rows, write_report
    from exgrpo.training.history import mixed_phase_start
    from exgrpo.training.launch import prepared_run

    console = Console()
    start = time.perf_counter()
    # a demo always starts fresh: a previous demo run in its directory is replaced
    config = load_config(args.config, overrides + ["logging.overwrite=true"])
    console.print(f"[bold]exgrpo demo[/]: {config.model.name} on {config.data.train} (in {config.logging.output_dir})")
    with prepared_run(config, resume=False, log=_note) as (run, _):
        trainer = run.trainer
        console.print(f"evaluating {len(trainer.eval_dataset)} held-out questions × {config.eval.samples} samples ...")
        before = trainer.evaluate()
        console.print(f"before training: {before}")
        history = trainer.train()
        ends_with_eval = bool(history) and "eval/accuracy" in history[-1]
        after = trainer.last_evaluation if ends_with_eval else trainer.evaluate()
    evaluations = [(0, before.mean)] + [(i + 1, m["eval/accuracy"]) for i, m in enumerate(history)
                                         if "eval/accuracy" in m]
    if not ends_with_eval:
        evaluations.append((len(history), after.mean))
    wall = time.perf_counter() - start
    table = Table(title="ExGRPO demo: held-out sampled accuracy")
    table.add_column("")
    table.add_column("value")
    for a, b in before_after_rows(before, after):
        table.add_row(a, b)
    switch = mixed_phase_start(history)
    table.add_row("steps / mixed phase from", f"{len(history)} / {switch or 'never (no replay: GRPO)'}")
    table.add_row("experiential questions replayed", f"{sum(m['experience/replayed'] for m in history):.0f}")
    table.add_row("wall time (this command)", f"{wall / 60:.1f} min")
    console.print(table)
    command = "exgrpo demo " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    report = write_report(config.logging.output_dir, history, evaluations, before, after, wall, command)
    console.print(f"report: {report}")
    return 0


def _experiment(args) -> int:
    """Run (or resume) the runs of a multi-seed study, say how far each got, or write its report."""
    from exgrpo.studies.study import load_study, run_study, study_status

    if args.overwrite and args.action != "run":
        raise ConfigError(f"--overwrite starts runs over: it goes with `exgrpo experiment run`, not {args.action}")
    study = load_study(args.study)
    # an arm named twice is one arm: its runs run and count once
    args.arms = list(dict.fromkeys(args.arms)) if args.arms else args.arms
    if args.action == "run":
        stopped = run_study(study, arms=args.arms, seeds=args.seeds, overwrite=args.overwrite,
                            log=lambda m: print(f"exgrpo experiment: {m}", flush=True))
        if stopped:
            _note(f"{stopped}: the study stopped after checkpointing the current run; continue it with `exgrpo "
                  f"experiment run {args.study}`")
        return _stop_code(stopped)
    if args.action == "status":
        print("\n".join(study_status(study, arms=args.arms, seeds=args.seeds)))
        return 0
    return _experiment_report(study, args)


def _experiment_report(study, args) -> int:
    """`exgrpo experiment report`: the baseline and the --main arms always among the reported ones."""
    from exgrpo.studies.report import write_study_report

    # baseline first, as --main says: left out, it was taken for an ablation and compared twice with the last arm
    main_arms = list(dict.fromkeys([study.baseline, *(args.main or [])]))
    for name in main_arms + (args.arms or []):
        study.arm(name)
    left_out = sorted({study.baseline, *main_arms} - set(args.arms)) if args.arms else []  # no --arms: all of them
    if left_out:
        raise ConfigError(f"--arms {' '.join(args.arms)} leaves out {', '.join(left_out)} (the baseline and the "
                          "--main arms are always reported)")
    output = Path(args.output)
    existing = next(p for p in (output, *output.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ExgrpoError(f"--output {output}: {existing} is a file; --output must be a directory")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExgrpoError(f"--output {output}: cannot write there ({e.strerror or e})") from None
    print(write_study_report(study, output, main_arms, args.arms, args.seeds))
    return 0


def _serve(args, overrides) -> int:
    """Start (or with --print, show) the `vllm serve` server of a rollout.engine servers run."""
    from exgrpo.rollout.serve import refuse_a_port_in_use, run_server, server_command

    config = load_config(args.config, overrides)
    if config.rollout.engine != "servers":
        raise ConfigError(f"exgrpo serve starts the servers of a rollout.engine servers run, not of rollout.engine "
                          f"{config.rollout.engine}")
    if not args.print:
        refuse_a_port_in_use(args.host, args.port)
    argv, env = server_command(config, args.host, args.port, args.vllm_args)
    if args.print:
        print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(argv))
        return 0
    return run_server(argv, env)


def _export(args) -> int:
    """A standalone model directory from a run (its newest intact checkpoint) or a checkpoint."""
    from exgrpo.export import export

    export(args.source, args.out, merge=args.merge, overwrite=args.overwrite, log=_note)
    return 0


def _buffer(args) -> int:
    """What the experience buffer of a run (its newest intact checkpoint) or a checkpoint holds."""
    from exgrpo.experience.summary import buffer_summary, print_summary
    from exgrpo.export import read_checkpoint

    if args.examples < 0:
        raise ExgrpoError(f"--examples must be >= 0 (got {args.examples})")
    try:  # a checkpoint a live run prunes while it is read gives way to its newest intact one
        source, (buffer, step, decode) = read_checkpoint(args.source, "buffer.safetensors",
                                                         lambda c: _read_buffer(c, args.examples), _note)
    except ValueError as e:
        raise ExgrpoError(str(e)) from None
    summary = buffer_summary(buffer, step, args.examples, decode)
    if args.json:
        print(json.dumps({"checkpoint": str(source), **summary}, indent=2))
    else:
        print_summary(summary, str(source))
    return 0


def _read_buffer(checkpoint: Path, examples: int):
    """A checkpoint's experience buffer, step and (when examples are shown) a decoder of its token ids."""
    from exgrpo.experience.buffer import ExperienceBuffer
    from exgrpo.runtime.checkpoint import read_trainer_json

    decode = None
    if (checkpoint / "model").is_dir() and examples:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint / "model")
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return ExperienceBuffer.load(checkpoint / "buffer.safetensors"), read_trainer_json(checkpoint)["step"], decode


def _add_buffer_parser(sub) -> None:
    p = sub.add_parser("buffer", help="what a run's experience buffer holds",
                       description="Print the experience buffer of the newest intact checkpoint of RUN (or of "
                                   "CHECKPOINT): questions and trajectories per correctness bucket, the "
                                   "trajectories' ages and use counts, and a few questions' stored trajectories "
                                   "decoded, with their recorded behaviour log-probs.")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("--examples", type=int, default=3, metavar="N",
                   help="questions whose trajectories are listed (those holding the most; default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start a vLLM rollout server for a rollout.engine servers run",
                       description="Run `vllm serve` with the flags a rollout.engine servers run needs, assembled "
                                   "from its config (docs/scale.md). Arguments after -- go to vllm serve as they are.",
                       epilog="Any config field can be overridden: section.field=value or --section.field value")
    p.add_argument("--config", help="the run's config: a preset or a YAML file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, required=True)
    p.add_argument("--print", action="store_true", help="print the command instead of running it")


def _port(text: str) -> int:
    """A TCP port number (argparse type): 1 to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1 to 65535)")
    return port


def _add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="a standalone HF model directory from a run or checkpoint",
                       description="Write the newest intact checkpoint of RUN (or CHECKPOINT) as a model directory "
                                   "that transformers, vLLM, lm-eval-harness and exgrpo eval load: weights, config, "
                                   "tokenizer, chat template.")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--merge", action="store_true", help="merge a LoRA adapter into its base (a plain model)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")


def _add_experiment_parser(sub) -> None:
    p = sub.add_parser("experiment", help="multi-seed studies: run (resumable), status and report",
                       description="Train every arm × seed of a study file (skipping complete runs, resuming "
                                   "interrupted ones), say how far each run got, or write the study's plots and "
                                   "tables.")
    p.add_argument("action", choices=["run", "status", "report"])
    p.add_argument("study", help="study YAML (see exgrpo.studies.study)")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="only these arms (report: the baseline and --main among them)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                   help="only these seeds (report: an interim report, which says so)")
    p.add_argument("--overwrite", action="store_true",
                   help="run: start the selected runs over, deleting what they hold (complete runs too)")
    p.add_argument("--output", default="docs/results", help="report: output directory (default: docs/results)")
    p.add_argument("--main", nargs="+", metavar="ARM",
                   help="report: the arms compared in the main plots, baseline first (default: the baseline)")


def _add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate models on the paper's benchmarks",
                       description="Sample each benchmark question under the paper's protocol, grade, and print "
                                   "a table with the paper's columns (one row per model).")
    p.add_argument("--model", action="append", required=True, metavar="PATH_OR_PRESET",
                   help="a preset (smollm2-135m-instruct, tiny), a local checkpoint or a HF id; repeat for a table")
    p.add_argument("--benchmarks", default="all",
                   help="comma list of aime24,aime25,amc,math500,minerva,olympiad,arc_c,gpqa, or all|id|ood "
                        "(default: all)")
    p.add_argument("--data", metavar="DIR_OR_FILE",
                   help="directory with test.id.parquet, ood.arc_c.parquet, ood.gpqa.parquet, or one parquet file "
                        "(default: $EXGRPO_BENCHMARKS)")
    p.add_argument("--hf", action="store_true", help="load the public Hugging Face copies instead (needs `datasets`)")
    p.add_argument("--samples", type=int, metavar="N",
                   help="samples per question on every benchmark (default: the paper's, 32 on AIME24/25 and AMC "
                        "and 1 elsewhere: avg@32 / pass@1)")
    p.add_argument("--limit", type=int, metavar="N", help="first N distinct questions per benchmark (quick runs)")
    p.add_argument("--max-new-tokens", type=int, default=8192)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--think", action="store_true",
                   help="end prompts with '<think>\\n' (think-tuned models); as released, a prompt that ends so has "
                        "only the text after the first '</think>' graded, or all of it without one")
    p.add_argument("--think-gate", action="store_true",
                   help="0 without a '</think>' (the training reward's gate; not the paper's eval)")
    p.add_argument("--keep-system", action="store_true", help="keep the data's system message (the paper drops it)")
    p.add_argument("--grade-all-text", action="store_true",
                   help="math: math-verify on all the graded text (the released training reward) instead of the "
                        "released evaluation grader on the last \\boxed{}")
    p.add_argument("--output", default="runs/eval", help="output directory (default: runs/eval)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64, help="sequences generated together")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                   help="hf: transformers generate; vllm: an in-process vLLM engine (needs the vllm extra)")
    p.add_argument("--workers", type=int, default=2, help="grading processes (0: grade in-process)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exgrpo", description="ExGRPO: experience replay for RLVR")
    parser.add_argument("--version", action="version", version=f"exgrpo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "train with ExGRPO"), ("demo", "before/after evaluation around training")):
        p = sub.add_parser(name, help=help_text,
                           epilog="Any config field can be overridden: section.field=value or --section.field value")
        p.add_argument("--config", default="demo" if name == "demo" else None,
                       help=f"a preset ({', '.join(preset_names())}) or a YAML file"
                            + (" (default: demo)" if name == "demo" else ""))
        if name == "train":
            p.add_argument("--resume", metavar="RUN_DIR|auto",
                           help="continue from the latest intact checkpoint of RUN_DIR (auto: of "
                                "logging.output_dir, starting fresh when there is no run there)")
            p.add_argument("--overwrite", action="store_true",
                           help="start a fresh run even if logging.output_dir holds another run (deletes it)")
    _add_eval_parser(sub)
    _add_experiment_parser(sub)
    _add_export_parser(sub)
    _add_buffer_parser(sub)
    _add_serve_parser(sub)
    return parser


_EVAL_FLAGS = (  # flag, its attribute, whether a value is allowed, what it must be
    ("--samples", "samples", lambda v: v is None or v >= 1, ">= 1"),
    ("--limit", "limit", lambda v: v is None or v >= 1, ">= 1"),
    ("--max-new-tokens", "max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("--temperature", "temperature", lambda v: math.isfinite(v) and v > 0,
     "a finite number > 0 (evaluation samples; there is no greedy mode)"),
    ("--top-p", "top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("--batch-size", "batch_size", lambda v: v >= 1, ">= 1 (sequences generated together)"),
    ("--seed", "seed", lambda v: v >= 0, ">= 0"),
    ("--workers", "workers", lambda v: v >= 0, ">= 0 (grading processes; 0 grades in-process)"),
)


def _check_eval_args(parser: argparse.ArgumentParser, args) -> None:
    """eval's own flags, refused by their names before anything is loaded; --output must be a directory that can be
    written (it is created here)."""
    bad = [f"{flag} must be {need} (got {getattr(args, name)})" for flag, name, ok, need in _EVAL_FLAGS
           if not ok(getattr(args, name))]
    if bad:
        parser.error("; ".join(bad))
    output = Path(args.output)
    existing = next((p for p in (output, *output.absolute().parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        parser.error(f"--output {output}: {existing} is a file; --output must be a directory")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--output {output}: cannot write there ({e.strerror or e})")


def _eval(args, argv: list[str]) -> int:
    from exgrpo.evaluation.evaluate import eval_command

    return eval_command(args, argv)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    own, vllm_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args, overrides = parser.parse_known_args(own)
    args.vllm_args = vllm_args
    if "--" in argv and args.command != "serve":
        parser.error("arguments after -- go to vllm serve: only exgrpo serve takes them")
    if overrides and args.command in ("eval", "experiment", "export", "buffer"):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.command == "eval":
        _check_eval_args(parser, args)
    library_format = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *rest: f"exgrpo: warning: {message}\n" \
        if issubclass(category, ExgrpoWarning) else library_format(message, category, *rest)
    try:
        with warnings.catch_warnings(), sigterm_stops_at_once():
            if launched_rank() != 0:  # under torchrun rank 0 warns for every rank
                warnings.filterwarnings("ignore", category=ExgrpoWarning)
            return {"train": _train, "demo": _demo, "eval": lambda a, _: _eval(a, argv),
                    "experiment": lambda a, _: _experiment(a), "export": lambda a, _: _export(a),
                    "buffer": lambda a, _: _buffer(a), "serve": _serve}[args.command](args, overrides)
    except ConfigError as e:
        print(f"exgrpo: config error: {e}", file=sys.stderr)
        return 2
    except ExgrpoError as e:
        print(f"exgrpo: error: {e}", file=sys.stderr)
        return 2
    except StopNow as e:
        _note(str(e) if args.command == "eval" else f"{e}; --resume continues from the last checkpoint")
        return _stop_code(e.signal_name)
    finally:
        warnings.formatwarning = library_format


if __name__ == "__main__":
    sys.exit(main())
